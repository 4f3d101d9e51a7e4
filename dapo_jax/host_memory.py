"""The host memory that XLA's compiler frees, given back to the operating system.

Compiling a step allocates and frees a few hundred MB on the host (on XLA:CPU mostly LLVM's code
generation). glibc's malloc keeps freed pages in its heap, so without help the process's
resident memory stays at the high-water mark of every compilation for the rest of the run.
`malloc_trim(0)` after each backend compilation returns those pages: on the peer benchmark's
64-token workload our peak RSS went from 883 to 725 MiB at the same step time
(experiments/README.md, 2026-12-04). Elsewhere than glibc (macOS, musl) all of this is a no-op.
"""

import ctypes
import functools

import jax

# the event `jax._src.dispatch` records when a backend compilation ends (jax >= 0.4.36)
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


@functools.cache
def _malloc_trim():
    """glibc's `malloc_trim`, or None where the C library has none."""
    return getattr(ctypes.CDLL(None), "malloc_trim", None)


def trim() -> bool:
    """Return the free pages of the C heap to the OS; whether any were (False off glibc)."""
    malloc_trim = _malloc_trim()
    return bool(malloc_trim is not None and malloc_trim(0))


def _on_duration(event: str, duration_secs: float, **kwargs) -> None:
    del duration_secs, kwargs
    if event == COMPILE_EVENT:
        trim()


@functools.cache
def trim_after_compiles() -> None:
    """Run `trim` after every XLA compilation of this process from now on (once per process,
    however often it is called)."""
    if _malloc_trim() is not None:
        jax.monitoring.register_event_duration_secs_listener(_on_duration)

"""glibc's malloc set up for XLA:CPU: freed buffers kept for the next execution, and the memory
that compilation frees given back to the operating system.

Two costs of glibc's defaults on a CPU backend (figures: experiments/README.md):
- Every execution of a compiled step mallocs its temporary buffer (tens to hundreds of MB) and
  frees it at the end. Above the mmap threshold (which glibc raises to at most 32 MiB) each one
  is a fresh mmap, and every page of it faults, zeroed by the kernel, on first touch, in every
  execution. With both thresholds at 2 GiB the buffers stay in the heap and are reused.
- Compiling a step allocates and frees a few hundred MB (mostly LLVM's code generation), which
  the heap then keeps: `malloc_trim(0)` after each compilation returns it.
Elsewhere than glibc (macOS, musl) all of this is a no-op.
"""

import ctypes
import functools

import jax

# the event `jax._src.dispatch` records when a backend compilation ends (jax >= 0.4.36)
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
# mallopt parameters (glibc's malloc.h) and the thresholds set: the largest a C int holds
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
KEEP_BELOW = 2**31 - 1


@functools.cache
def _glibc():
    """The C library when it is glibc (it has `malloc_trim`), else None."""
    libc = ctypes.CDLL(None)
    return libc if hasattr(libc, "malloc_trim") and hasattr(libc, "mallopt") else None


def trim() -> bool:
    """Return the free pages of the C heap to the OS; whether any were (False off glibc)."""
    libc = _glibc()
    return bool(libc is not None and libc.malloc_trim(0))


def _on_duration(event: str, duration_secs: float, **kwargs) -> None:
    del duration_secs, kwargs
    if event == COMPILE_EVENT:
        trim()


@functools.cache
def tune_for_xla_cpu() -> None:
    """For the rest of this process: allocations below 2 GiB served from the heap and freed
    memory kept there (mmap and trim thresholds, `mallopt`), and `trim` after every XLA
    compilation. Once per process, however often it is called; for a CPU backend (an
    accelerator's buffers are not on this heap, and a host that loads a large checkpoint had
    better give its buffers back)."""
    libc = _glibc()
    if libc is None:
        return
    for param in (M_MMAP_THRESHOLD, M_TRIM_THRESHOLD):
        if not libc.mallopt(param, KEEP_BELOW):
            raise RuntimeError(f"glibc mallopt({param}, {KEEP_BELOW}) was refused")
    jax.monitoring.register_event_duration_secs_listener(_on_duration)

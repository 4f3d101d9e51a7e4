"""glibc's malloc as `host_memory` sets it up: freed buffers kept in the heap for reuse, `trim`
returning what is free, and a trim after each XLA compilation."""

import ctypes

import jax
import jax.numpy as jnp
import pytest

from dapo_jax import host_memory

pytestmark = pytest.mark.skipif(host_memory._glibc() is None, reason="not glibc")

MIB = 1 << 20


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        return int(f.read().split("VmRSS:")[1].split()[0]) / 1024


@pytest.fixture(scope="module")
def libc():
    lib = ctypes.CDLL(None)
    lib.malloc.restype = ctypes.c_void_p
    lib.malloc.argtypes = [ctypes.c_size_t]
    lib.free.argtypes = [ctypes.c_void_p]
    lib.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
    return lib


def _touched(libc, size: int):
    p = libc.malloc(size)
    libc.memset(p, 1, size)  # touch the pages: they count in RSS
    return p


def test_trim_returns_freed_heap_below_a_live_block(libc):
    """200 MiB of 1 KiB blocks freed under one block still live: glibc cannot shrink the heap's
    top past that block, so the pages stay resident until `trim`."""
    blocks = [_touched(libc, 1024) for _ in range(200 * 1024)]
    for b in blocks[:-1]:
        libc.free(b)
    freed = _rss_mib()
    assert host_memory.trim()
    trimmed = _rss_mib()
    libc.free(blocks[-1])
    assert freed - trimmed > 150, (freed, trimmed)


def test_large_buffers_are_kept_for_reuse_once_tuned(libc):
    """A freed 96 MiB buffer (an XLA:CPU execution's temporaries) is unmapped at once by glibc's
    defaults (it is above their 32 MiB mmap threshold); once tuned it stays resident, the next
    one of that size reuses its pages, and `trim` gives them back."""
    before = _rss_mib()
    if not host_memory.tune_for_xla_cpu.cache_info().currsize:  # not tuned yet in this process
        libc.free(_touched(libc, 96 * MIB))
        assert _rss_mib() - before < 16  # glibc's defaults: an mmap, unmapped by free
        host_memory.tune_for_xla_cpu()
    libc.free(_touched(libc, 96 * MIB))
    kept = _rss_mib()
    assert kept - before > 80
    libc.free(_touched(libc, 96 * MIB))
    assert _rss_mib() - kept < 16  # the same pages again
    host_memory.trim()
    assert _rss_mib() - before < 16


def test_trim_runs_after_each_compilation(monkeypatch):
    x, y = jnp.arange(7.0), jnp.ones(7)
    calls = []
    monkeypatch.setattr(host_memory, "trim", lambda: calls.append(1) or True)
    host_memory.tune_for_xla_cpu()
    host_memory.tune_for_xla_cpu()  # a second call registers nothing more
    f = jax.jit(lambda v: jnp.sin(v) * 3.0 + 1.0)
    f(x).block_until_ready()
    assert len(calls) == 1
    f(y).block_until_ready()  # compiled: no compilation, no trim
    assert len(calls) == 1
    jax.jit(lambda v: jnp.cos(v) - 2.0)(x).block_until_ready()
    assert len(calls) == 2

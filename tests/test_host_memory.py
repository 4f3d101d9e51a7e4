"""Giving freed heap back to the OS: `trim` returns pages that glibc's malloc would keep, and the
listener runs it after each XLA compilation."""

import ctypes

import jax
import jax.numpy as jnp
import pytest

from dapo_jax import host_memory

pytestmark = pytest.mark.skipif(host_memory._malloc_trim() is None, reason="no glibc malloc_trim here")


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        return int(f.read().split("VmRSS:")[1].split()[0]) / 1024


def test_trim_returns_freed_heap_below_a_live_block():
    """200 MiB of 1 KiB blocks freed under one block still live: glibc cannot shrink the heap's
    top past that block, so the pages stay resident until `trim`."""
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
    blocks = [libc.malloc(1024) for _ in range(200 * 1024)]
    for b in blocks:
        libc.memset(b, 1, 1024)  # touch the pages: they count in RSS
    for b in blocks[:-1]:
        libc.free(b)
    freed = _rss_mib()
    assert host_memory.trim()
    trimmed = _rss_mib()
    libc.free(blocks[-1])
    assert freed - trimmed > 150, (freed, trimmed)


def test_trim_runs_after_each_compilation(monkeypatch):
    x, y = jnp.arange(7.0), jnp.ones(7)
    calls = []
    monkeypatch.setattr(host_memory, "trim", lambda: calls.append(1) or True)
    host_memory.trim_after_compiles()
    host_memory.trim_after_compiles()  # a second call registers nothing more
    f = jax.jit(lambda v: jnp.sin(v) * 3.0 + 1.0)
    f(x).block_until_ready()
    assert len(calls) == 1
    f(y).block_until_ready()  # compiled: no compilation, no trim
    assert len(calls) == 1
    jax.jit(lambda v: jnp.cos(v) - 2.0)(x).block_until_ready()
    assert len(calls) == 2

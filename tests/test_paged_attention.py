"""Paged decode attention against the reference of jax's ragged paged attention kernel, and the
kernel itself compiled for TPU (by AOT, where libtpu is installed)."""

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ref_ragged_paged_attention

from dapo_jax import paged_attention as pa


def _case(lengths, z=4, k=2, r=3, e=8, spare=5, seed=0):
    """Random pages and queries; each row's pages drawn without repeats from a shuffled pool."""
    rng = np.random.default_rng(seed)
    b = len(lengths)
    i = max(-(-max(lengths) // z), 1) + 1
    m = b * i + spare
    pages = rng.normal(size=(m, z, 2 * k, e)).astype(np.float32)
    table = rng.permutation(m)[: b * i].reshape(b, i).astype(np.int32)
    q = rng.normal(size=(b, k, r, e)).astype(np.float32)
    return q, pages, np.asarray(lengths, np.int32), table


def _reference(q, pages, lengths, table):
    b, k, r, e = q.shape
    out = ref_ragged_paged_attention(
        jnp.asarray(q.reshape(b, k * r, e)),
        jnp.asarray(pages),
        jnp.asarray(lengths),
        jnp.asarray(table),
        jnp.arange(b + 1, dtype=jnp.int32),
        jnp.array([b], jnp.int32),
        sm_scale=1 / np.sqrt(e),
    )
    return np.asarray(out).reshape(b, k, r, e)


@pytest.mark.parametrize("block_pages", [1, 3, 64])
def test_paged_decode_attention_equals_the_kernels_reference(block_pages):
    """Rows of 1 key, of a page and one key, of whole pages, of many pages; blocks of one pair,
    blocks that cut rows, one block for all: the reference kernel's outputs."""
    q, pages, lengths, table = _case([1, 5, 8, 17, 3, 12])
    got = pa.paged_decode_attention(q, pages, lengths, table, block_pages)
    np.testing.assert_allclose(np.asarray(got), _reference(q, pages, lengths, table), atol=2e-6)


def test_a_row_reads_only_its_held_keys():
    """Keys past a row's length and pages outside its table change nothing; a row with no keys
    (an idle slot) gets zeros, and the rows beside it are unchanged."""
    q, pages, lengths, table = _case([6, 9, 0], spare=3)
    got = np.asarray(pa.paged_decode_attention(q, pages, lengths, table, 2))
    noisy = pages.copy()
    noisy[table[0, 1], 2:] = 1e3  # row 0's keys 6, 7 (past its length)
    noisy[table[2]] = -1e3  # the empty row's pages
    unheld = np.setdiff1d(np.arange(len(pages)), table[:2].ravel())
    noisy[unheld] = 7.0
    again = np.asarray(pa.paged_decode_attention(q, noisy, lengths, table, 2))
    np.testing.assert_array_equal(again, got)
    assert np.all(got[2] == 0)
    np.testing.assert_allclose(got[:2], _reference(q[:2], pages, lengths[:2], table[:2]), atol=2e-6)


def test_shared_pages_are_read_by_every_row_holding_them():
    """Two rows whose tables name the same page read the same keys there (a prompt's full page,
    shared by its responses)."""
    q, pages, lengths, table = _case([8, 7, 2, 1])
    table[1, 0] = table[0, 0]
    got = pa.paged_decode_attention(q, pages, lengths, table, 2)
    np.testing.assert_allclose(np.asarray(got), _reference(q, pages, lengths, table), atol=2e-6)


def test_write_pages_puts_each_row_at_its_slot_and_drops_past_the_pool():
    rng = np.random.default_rng(1)
    pages = rng.normal(size=(5, 4, 4, 3)).astype(np.float32)
    k, v = rng.normal(size=(2, 3, 2, 3)).astype(np.float32)
    got = np.asarray(pa.write_pages(jnp.asarray(pages), k, v, np.array([2, 5, 0]), np.array([3, 1, 0])))
    want = pages.copy()
    want[2, 3, 0::2], want[2, 3, 1::2] = k[0], v[0]  # row 1's page 5 lies past the pool of 5
    want[0, 0, 0::2], want[0, 0, 1::2] = k[2], v[2]
    np.testing.assert_array_equal(got, want)


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="needs libtpu (abstract TPU devices)")
def test_the_kernel_compiles_for_tpu():
    """`kernel_decode_attention` lowered and compiled for one abstract v5p chip (Pallas sees the TPU
    kind inside `jax.set_mesh`; a Mosaic kernel is not partitioned, so a mesh of more chips calls
    it inside a shard_map): bf16 pages of 16 slots, 8 kv heads x 8 queries, 128 wide."""
    from jax.experimental import topologies  # noqa: PLC0415

    devices = topologies.get_topology_desc(
        platform="tpu",
        topology_name="v5p:2x2x1",
        chip_config_name="default",
        chips_per_host_bounds=(2, 2, 1),
        num_slices=1,
    ).devices
    mesh = jax.sharding.Mesh(np.asarray(devices[:1]), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    b, k, r, e, m, z, i = 8, 8, 8, 128, 64, 16, 8
    args = (
        jax.ShapeDtypeStruct((b, k, r, e), jnp.bfloat16),
        jax.ShapeDtypeStruct((m, z, 2 * k, e), jnp.bfloat16),
        jax.ShapeDtypeStruct((b,), jnp.int32),
        jax.ShapeDtypeStruct((b, i), jnp.int32),
    )
    with jax.set_mesh(mesh):
        compiled = jax.jit(pa.kernel_decode_attention).lower(*args).compile()
    assert "ragged_paged_attention_kernel" in compiled.as_text()

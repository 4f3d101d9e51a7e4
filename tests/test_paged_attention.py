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


@pytest.mark.parametrize("run_pages", [1, 2, 4])
@pytest.mark.parametrize("block_pages", [1, 3, 64])
def test_paged_decode_attention_equals_the_kernels_reference(block_pages, run_pages):
    """Rows of 1 key, of a page and one key, of whole pages, of many pages; runs of one page, of
    two (rows of an odd number of pages), of four (tables of 6 pages: the last run past them);
    blocks of one run, blocks that cut rows, one block for all: the reference kernel's outputs."""
    q, pages, lengths, table = _case([1, 5, 8, 17, 3, 12])
    got = pa.paged_decode_attention(q, pages, lengths, table, block_pages, run_pages)
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


def test_decode_step_writes_its_layers_pages_then_reads_them():
    """A pool of 2 layers x M = 10 pages, layer 1's step: each row's key and value land in layer
    1's page (10 + its page id), a write to page M lands nowhere (not in layer 2's first page, nor
    past the pool), layer 0 is untouched, and each row's query reads its keys in layer 1, the new
    one included: the kernel's reference on the pool written by hand."""
    q, pages, lengths, table = _case([5, 2, 8], spare=1)  # 3 x 3 + 1 pages of 4 slots, 2 kv heads
    m = len(pages)
    rng = np.random.default_rng(3)
    layer0 = rng.normal(size=pages.shape).astype(np.float32)
    pool = np.concatenate([layer0, pages])
    k, v = rng.normal(size=(2, 3, 2, 8)).astype(np.float32)
    write_page, write_slot = np.array([table[0, 1], m, table[2, 1]]), np.array([0, 1, 3])
    refs = pa.PageRefs(table, lengths, write_page, write_slot, layer=1)
    out, got = pa.decode_step(jnp.asarray(q), k, v, jnp.asarray(pool), refs, layers=2)
    want = pool.copy()
    for b in (0, 2):
        want[m + write_page[b], write_slot[b], 0::2] = k[b]
        want[m + write_page[b], write_slot[b], 1::2] = v[b]
    np.testing.assert_array_equal(np.asarray(got), want)
    np.testing.assert_allclose(np.asarray(out), _reference(q, want[m:], lengths, table), atol=2e-6)
    cpu = jax.sharding.Mesh(jax.devices()[:1], ("tensor",))
    assert not pa.uses_kernel(128) and not pa.uses_kernel(128, cpu)


def _abstract_tpu_devices():
    from jax.experimental import topologies  # noqa: PLC0415

    return topologies.get_topology_desc(
        platform="tpu",
        topology_name="v5p:2x2x1",
        chip_config_name="default",
        chips_per_host_bounds=(2, 2, 1),
        num_slices=1,
    ).devices


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="needs libtpu (abstract TPU devices)")
def test_decode_step_runs_the_kernel_on_tpu_heads_split_over_tensor():
    """On a mesh of 4 abstract v5p chips (tensor 4) `decode_step` of layer 1 of a 2-layer pool
    runs the Pallas kernel on each chip's 2 of 8 kv heads (in a shard_map over tensor), and
    writes the donated pool in place: the compiler's temporaries hold less than one chip's
    share of the pool. Inside a shard_map manual over tensor already (a caller's, over every axis) it calls
    the kernel on the chip's heads as they are."""
    mesh = jax.sharding.Mesh(np.asarray(_abstract_tpu_devices()), ("tensor",))
    b, k, r, e, m, z, i = 16, 8, 4, 128, 512, 16, 8
    named = lambda *spec: jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec))
    heads, rep = named(None, "tensor"), named()
    pool = jax.ShapeDtypeStruct((2 * m, z, 2 * k, e), jnp.bfloat16, sharding=named(None, None, "tensor"))
    ints = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=rep)
    args = (
        jax.ShapeDtypeStruct((b, k, r, e), jnp.bfloat16, sharding=heads),
        jax.ShapeDtypeStruct((b, k, e), jnp.bfloat16, sharding=heads),
        jax.ShapeDtypeStruct((b, k, e), jnp.bfloat16, sharding=heads),
        pool,
        pa.PageRefs(ints(b, i), ints(b), ints(b), ints(b), 1),
    )
    assert pa.uses_kernel(e, mesh) and not pa.uses_kernel(64, mesh)  # the kernel's 128 lanes
    step = jax.jit(lambda *a: pa.decode_step(*a, layers=2), donate_argnums=(3,))
    with jax.set_mesh(mesh):
        assert pa.uses_kernel(e)
        compiled = step.lower(*args).compile()
    assert "ragged_paged_attention_kernel" in compiled.as_text()
    pool_per_chip = 2 * m * z * 2 * k * e * 2 / 4
    assert compiled.memory_analysis().temp_size_in_bytes < pool_per_chip
    arrays = (*args[:4], *args[4][:4])
    per_device = jax.shard_map(
        lambda q, k, v, pool, *refs: pa.decode_step(q, k, v, pool, pa.PageRefs(*refs, 1), layers=2),
        mesh=mesh,
        in_specs=tuple(x.sharding.spec for x in arrays),
        out_specs=(args[0].sharding.spec, pool.sharding.spec),
        check_vma=False,
    )
    with jax.set_mesh(mesh):
        assert "ragged_paged_attention_kernel" in jax.jit(per_device).lower(*arrays).compile().as_text()


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="needs libtpu (abstract TPU devices)")
def test_the_kernel_compiles_for_tpu():
    """`kernel_decode_attention` lowered and compiled for one abstract v5p chip (Pallas sees the TPU
    kind inside `jax.set_mesh`; a Mosaic kernel is not partitioned, so a mesh of more chips calls
    it inside a shard_map): bf16 pages of 16 slots, 8 kv heads x 8 queries, 128 wide."""
    devices = _abstract_tpu_devices()
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

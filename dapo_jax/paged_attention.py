"""Paged KV cache and the decode attention that reads only the pages a row holds.

Layout (the one of jax's ragged paged attention TPU kernel,
`jax.experimental.pallas.ops.tpu.ragged_paged_attention`): a layer's cache is a pool of M pages
of Z slots, `pages_MxZxUxE`, whose U = 2K combined heads interleave keys and values (2k: key
head k, 2k + 1: value head k). Row b's keys are its sequence's tokens in order, key s in slot
s % Z of page `table_BxI[b, s // Z]`; it holds `lengths_B[b]` of them. Pages are shared between
rows by putting one page id in several tables (a prompt's full pages, read by its G responses).
The model's L layers keep their pools in one array, `pool_AxZxUxE` (A = L x M: layer l's page p
at l x M + p), which a decode step's layers update in place one after another (`decode_step`).

Two attentions over it, the same numbers to float rounding:
- `paged_decode_attention` (pure JAX, any backend): the runs of `run_pages` consecutive pages
  that hold a row's keys, `block_pages` pages of them at a time, one `while_loop` iteration a
  block (as many as the runs need), partial softmaxes merged per row. Its cost follows the sum of
  the rows' lengths (to a run), not the rows times the longest.
- `kernel_decode_attention`: the Pallas TPU kernel itself (compiles for TPU only).
`decode_step` runs the kernel where the mesh's devices are TPUs and the heads a multiple of 128
wide (`uses_kernel`), else the pure path.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

_NEG_INF = -1e30
KERNEL_BLOCK_PAGES = 16  # pages of a row the kernel fetches per flash block


class PageRefs(NamedTuple):
    """Where a decode step's rows read and write (the same for every layer)."""

    table_BxI: jax.Array  # page ids of row b's keys, I = pages a row may hold
    lengths_B: jax.Array  # keys row b holds, the one written this step included
    write_page_B: jax.Array  # page of this step's key and value; M (past the pool): no write
    write_slot_B: jax.Array  # its slot within that page
    layer: jax.Array | int = 0  # l, the layer reading them: its pages lie at l x M + page id


def interleave_kv(k_SxKxE, v_SxKxE):
    """`kv_SxUxE`: the keys and values of S positions with their K heads interleaved (U = 2K)."""
    s, k, e = k_SxKxE.shape
    return jnp.stack([k_SxKxE, v_SxKxE], axis=2).reshape(s, 2 * k, e)


def write_pages(pages_MxZxUxE, k_BxKxE, v_BxKxE, page_B, slot_B):
    """`pages_MxZxUxE` with row b's key and value at slot `slot_B[b]` of page `page_B[b]`; a page
    id of M or more writes nothing."""
    kv_BxUxE = interleave_kv(k_BxKxE, v_BxKxE).astype(pages_MxZxUxE.dtype)
    return pages_MxZxUxE.at[page_B, slot_B].set(kv_BxUxE, mode="drop")


RUN_PAGES = 4  # pages of one row a run reads at once: one query against run x Z keys


class _Runs(NamedTuple):
    """The (row, run) pairs that hold keys, row by row, padded to whole blocks (row B: none)."""

    row_X: jax.Array
    pages_XxC: jax.Array  # the run's C page ids (pages past the row's table: page 0, masked)
    first_key_X: jax.Array  # the row's key in the run's first slot


def _runs(lengths_B, table_BxI, z: int, run: int, block: int) -> tuple[_Runs, jax.Array]:
    """`(runs, count)`: row b's ceil(lengths_B[b] / (run x Z)) runs in order, then empty ones up
    to whole blocks of `block` runs; `count` the runs that hold keys."""
    b, i = table_BxI.shape
    per_row = -(-i // run)
    table_BxJxC = jnp.pad(table_BxI, ((0, 0), (0, per_row * run - i))).reshape(b, per_row, run)
    runs_B = -(-lengths_B // (run * z))
    ends_B = jnp.cumsum(runs_B)
    x_X = jnp.arange(-(-(b * per_row) // block) * block, dtype=jnp.int32)
    row_X = jnp.searchsorted(ends_B, x_X, side="right").astype(jnp.int32)
    clamped_row_X = jnp.minimum(row_X, b - 1)
    j_X = jnp.clip(x_X - (ends_B - runs_B)[clamped_row_X], 0, per_row - 1)  # the run's place in its row
    runs = _Runs(row_X, table_BxJxC[clamped_row_X, j_X], j_X * run * z)
    # materialised here: fused into the loop's page gather, this index arithmetic ran once per
    # gathered element (XLA:CPU's gather fusion; experiments/README.md)
    return jax.lax.optimization_barrier(runs), ends_B[-1]


def _block_partials(q_BxKxRxE, pages_MxZxUxE, lengths_B, runs: _Runs):
    """Softmax partials of a block's X runs: `(row_X, max_XxKxR, sum_XxKxR, out_XxKxRxE)`, row B
    for a run past the last."""
    b = q_BxKxRxE.shape[0]
    x, c = runs.pages_XxC.shape
    _, z, u, e = pages_MxZxUxE.shape
    valid_X = runs.row_X < b
    clamped_row_X = jnp.minimum(runs.row_X, b - 1)
    kv_XxSxUxE = pages_MxZxUxE[runs.pages_XxC].astype(jnp.float32).reshape(x, c * z, u, e)
    k_XxSxKxE, v_XxSxKxE = kv_XxSxUxE[:, :, 0::2], kv_XxSxUxE[:, :, 1::2]
    q_XxKxRxE = q_BxKxRxE[clamped_row_X].astype(jnp.float32) / math.sqrt(e)
    scores_XxKxRxS = jnp.einsum("xkre,xske->xkrs", q_XxKxRxE, k_XxSxKxE)
    keys_XxS = runs.first_key_X[:, None] + jnp.arange(c * z)
    held_XxS = (keys_XxS < lengths_B[clamped_row_X][:, None]) & valid_X[:, None]
    scores_XxKxRxS = jnp.where(held_XxS[:, None, None], scores_XxKxRxS, _NEG_INF)
    max_XxKxR = scores_XxKxRxS.max(-1)
    p_XxKxRxS = jnp.exp(scores_XxKxRxS - max_XxKxR[..., None])
    out_XxKxRxE = jnp.einsum("xkrs,xske->xkre", p_XxKxRxS, v_XxSxKxE)
    return jnp.where(valid_X, runs.row_X, b), max_XxKxR, p_XxKxRxS.sum(-1), out_XxKxRxE


def paged_decode_attention(
    q_BxKxRxE, pages_MxZxUxE, lengths_B, table_BxI, block_pages: int, run_pages: int = RUN_PAGES
):
    """`out_BxKxRxE`: softmax(q k^T / sqrt(E)) v of one query per row over the `lengths_B[b]` keys
    its pages hold (R queries per kv head; scores and sums in float32). Each row's pages are
    read in runs of `run_pages` consecutive ones of its table (its last run masked past its
    keys), `block_pages` pages a block (at least one run), for as many blocks as the runs fill;
    each block's partial maxima, sums and outputs merge into the rows' (flash-decoding). Runs of
    one page scored each page's Z keys as a dot of its own; a run's R x (run x Z) scores are one
    (figures: experiments/README.md). A row with no keys gets zeros."""
    q_BxKxRxE, pages_MxZxUxE, lengths_B, table_BxI = map(
        jnp.asarray, (q_BxKxRxE, pages_MxZxUxE, lengths_B, table_BxI)
    )
    b, k, r, e = q_BxKxRxE.shape
    run = min(run_pages, table_BxI.shape[1])
    per_block = max(block_pages // run, 1)
    runs, count = _runs(lengths_B, table_BxI, pages_MxZxUxE.shape[1], run, per_block)

    def block(carry):
        i, max_BxKxR, sum_BxKxR, out_BxKxRxE = carry
        block_runs = _Runs(*(jax.lax.dynamic_slice_in_dim(x, i * per_block, per_block) for x in runs))
        row_X, max_XxKxR, sum_XxKxR, out_XxKxRxE = _block_partials(
            q_BxKxRxE, pages_MxZxUxE, lengths_B, block_runs
        )
        new_max_BxKxR = max_BxKxR.at[row_X].max(max_XxKxR, mode="drop")
        old_scale_BxKxR = jnp.exp(max_BxKxR - new_max_BxKxR)
        pair_scale_XxKxR = jnp.exp(max_XxKxR - new_max_BxKxR[jnp.minimum(row_X, b - 1)])
        sum_BxKxR = (sum_BxKxR * old_scale_BxKxR).at[row_X].add(sum_XxKxR * pair_scale_XxKxR, mode="drop")
        out_BxKxRxE = (
            (out_BxKxRxE * old_scale_BxKxR[..., None])
            .at[row_X]
            .add(out_XxKxRxE * pair_scale_XxKxR[..., None], mode="drop")
        )
        return i + 1, new_max_BxKxR, sum_BxKxR, out_BxKxRxE

    init = (
        jnp.zeros((), jnp.int32),
        jnp.full((b, k, r), _NEG_INF, jnp.float32),
        jnp.zeros((b, k, r), jnp.float32),
        jnp.zeros((b, k, r, e), jnp.float32),
    )
    _, _, sum_BxKxR, out_BxKxRxE = jax.lax.while_loop(lambda carry: carry[0] * per_block < count, block, init)
    return (out_BxKxRxE / jnp.maximum(sum_BxKxR, 1e-30)[..., None]).astype(q_BxKxRxE.dtype)


def kernel_decode_attention(
    q_BxKxRxE, pages_MxZxUxE, lengths_B, table_BxI, block_pages: int = KERNEL_BLOCK_PAGES
):
    """`paged_decode_attention` by jax's ragged paged attention Pallas kernel (TPU only): one query
    per row, every row a sequence; `block_pages` pages a row per flash block (given, so that the
    kernel does not look its tuned sizes up on the host's devices, which fails in an AOT compile).
    A row with no keys (an idle slot) reads its table's first key, whose output is not used: the
    kernel skips a row of length 0 without consuming the block it prefetched for it, and the
    next row would read that block as its own."""
    from jax.experimental.pallas.ops.tpu import ragged_paged_attention as rpa  # noqa: PLC0415

    b, k, r, e = q_BxKxRxE.shape
    out = rpa.ragged_paged_attention(
        q_BxKxRxE.reshape(b, k * r, e),
        pages_MxZxUxE,
        jnp.maximum(lengths_B, 1).astype(jnp.int32),
        table_BxI.astype(jnp.int32),
        jnp.arange(b + 1, dtype=jnp.int32),
        jnp.array([b], jnp.int32),
        sm_scale=1.0 / math.sqrt(e),
        num_kv_pages_per_block=min(block_pages, table_BxI.shape[1]),
        num_queries_per_block=min(b, 32),
    )
    return out.reshape(b, k, r, e)


KERNEL_LANES = 128  # the kernel keeps its softmax sums in vregs of 128 lanes, broadcast over E
KERNEL_SMEM_BYTES = 2**20  # a TPU core's scalar memory, where the kernel prefetches the page tables


def kernel_max_rows(table_pages: int) -> int:
    """The most rows whose page tables, I = `table_pages` int32 entries each, the kernel
    prefetches into scalar memory, 7/8 of it (the rest for its lengths and offsets); beyond it
    the kernel does not compile (seen: 256 rows x 1408 pages, 1.38 MiB)."""
    return KERNEL_SMEM_BYTES * 7 // 8 // (4 * table_pages)


def uses_kernel(head_dim: int, mesh=None) -> bool:
    """Whether a decode step's attention runs the Pallas kernel: when `mesh` (default: the
    current one) is made of TPU devices, abstract ones included (an AOT compile), and the head
    width E is a multiple of the kernel's 128 lanes (its sums, 128 wide, broadcast over E: a
    narrower head fails inside the kernel); elsewhere (CPU, GPU, no mesh, a small test model on
    TPU) the pure-JAX `paged_decode_attention`."""
    abstract = jax.sharding.get_abstract_mesh() if mesh is None else mesh.abstract_mesh
    device = getattr(abstract, "abstract_device", None)
    tpu = not abstract.empty and device is not None and device.platform == "tpu"
    return tpu and head_dim % KERNEL_LANES == 0


def decode_step(q_BxKxRxE, k_BxKxE, v_BxKxE, pool_AxZxUxE, refs: PageRefs, layers: int):
    """`(out_BxKxRxE, pool_AxZxUxE)`: one layer's decode step over the pool of all `layers`
    layers' pages (A = L x M, layer l = `refs.layer` at pages l x M ..): row b's key and value
    written at slot `refs.write_slot_B[b]` of its page `refs.write_page_B[b]` (M: none), then its
    query attends over its `refs.lengths_B[b]` keys. Where `uses_kernel`, by the Pallas kernel
    in a `jax.shard_map` over the mesh's `tensor` axis (a Mosaic kernel is not partitioned: each
    chip writes and reads its K / T kv heads, 2K / T combined ones of the pool as it lies), or
    directly where `tensor` is manual already (inside a caller's shard_map over every axis, the
    chip holds its heads); elsewhere by
    `paged_decode_attention`, in blocks of B runs (`RUN_PAGES` x B pages)."""
    m = pool_AxZxUxE.shape[0] // layers
    first = refs.layer * m
    page_B = jnp.where(refs.write_page_B < m, first + refs.write_page_B, pool_AxZxUxE.shape[0])
    table_BxI = first + refs.table_BxI
    kernel = uses_kernel(q_BxKxRxE.shape[-1])

    def step(q_BxKxRxE, k_BxKxE, v_BxKxE, pool_AxZxUxE, page_B, slot_B, lengths_B, table_BxI):
        pool_AxZxUxE = write_pages(pool_AxZxUxE, k_BxKxE, v_BxKxE, page_B, slot_B)
        if kernel:
            return kernel_decode_attention(q_BxKxRxE, pool_AxZxUxE, lengths_B, table_BxI), pool_AxZxUxE
        b = q_BxKxRxE.shape[0]
        out_BxKxRxE = paged_decode_attention(q_BxKxRxE, pool_AxZxUxE, lengths_B, table_BxI, RUN_PAGES * b)
        return out_BxKxRxE, pool_AxZxUxE

    args = (q_BxKxRxE, k_BxKxE, v_BxKxE, pool_AxZxUxE, page_B, refs.write_slot_B, refs.lengths_B, table_BxI)
    if not kernel or "tensor" in jax.sharding.get_abstract_mesh().manual_axes:  # (inside a shard_map)
        return step(*args)
    heads, pool, rep = PartitionSpec(None, "tensor"), PartitionSpec(None, None, "tensor"), PartitionSpec()
    return jax.shard_map(
        step,
        in_specs=(heads, heads, heads, pool, rep, rep, rep, rep),
        out_specs=(heads, pool),
        axis_names={"tensor"},
        check_vma=False,
    )(*args)

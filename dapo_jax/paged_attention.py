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
- `paged_decode_attention` (pure JAX, any backend): the (row, page) pairs that hold keys, in
  blocks of `block_pages` pairs, one `while_loop` iteration a block (as many as the pairs need),
  partial softmaxes merged per row. Its cost follows the sum of the rows' lengths, not the rows
  times the longest.
- `kernel_decode_attention`: the Pallas TPU kernel itself (compiles for TPU only).
`decode_step` runs the kernel where the mesh's devices are TPUs (`uses_kernel`), else the pure path.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

_NEG_INF = -1e30
KERNEL_BLOCK_PAGES = 16  # F: pages of a row the kernel fetches per flash block


class PageRefs(NamedTuple):
    """Where a decode step's rows read and write (the same for every layer)."""

    table_BxI: jax.Array  # page ids of row b's keys, I = pages a row may hold
    lengths_B: jax.Array  # keys row b holds, the one written this step included
    write_page_B: jax.Array  # page of this step's key and value; M (past the pool): no write
    write_slot_B: jax.Array  # its slot within that page
    layer: jax.Array | int = 0  # l, the layer reading them: its pages lie at l x M + page id


def interleave_kv(k_XxKxE, v_XxKxE):
    """`kv_XxUxE`: keys and values of X tokens with their K heads interleaved (U = 2K)."""
    x, k, e = k_XxKxE.shape
    return jnp.stack([k_XxKxE, v_XxKxE], axis=2).reshape(x, 2 * k, e)


def write_pages(pages_MxZxUxE, k_BxKxE, v_BxKxE, page_B, slot_B):
    """`pages_MxZxUxE` with row b's key and value at slot `slot_B[b]` of page `page_B[b]`; a page
    id of M or more writes nothing."""
    kv_BxUxE = interleave_kv(k_BxKxE, v_BxKxE).astype(pages_MxZxUxE.dtype)
    return pages_MxZxUxE.at[page_B, slot_B].set(kv_BxUxE, mode="drop")


def _block_partials(q_BxKxRxE, pages_MxZxUxE, lengths_B, table_BxI, pair_C, first_page_B, pairs_end_B):
    """Softmax partials of C (row, page) pairs: `(row_C, max_CxKxR, sum_CxKxR, out_CxKxRxE)`,
    row B for a pair past the last."""
    b = q_BxKxRxE.shape[0]
    z = pages_MxZxUxE.shape[1]
    row_C = jnp.searchsorted(pairs_end_B, pair_C, side="right").astype(jnp.int32)
    valid_C = row_C < b
    row_c = jnp.minimum(row_C, b - 1)
    j_C = pair_C - first_page_B[row_c]  # the pair's page within its row
    page_C = table_BxI[row_c, jnp.clip(j_C, 0, table_BxI.shape[1] - 1)]
    kv_CxZxUxE = pages_MxZxUxE[page_C].astype(jnp.float32)
    k_CxZxKxE, v_CxZxKxE = kv_CxZxUxE[:, :, 0::2], kv_CxZxUxE[:, :, 1::2]
    q_CxKxRxE = q_BxKxRxE[row_c].astype(jnp.float32) / math.sqrt(q_BxKxRxE.shape[-1])
    scores_CxKxRxZ = jnp.einsum("ckre,czke->ckrz", q_CxKxRxE, k_CxZxKxE)
    keys_CxZ = j_C[:, None] * z + jnp.arange(z)
    held_CxZ = (keys_CxZ < lengths_B[row_c][:, None]) & valid_C[:, None]
    scores_CxKxRxZ = jnp.where(held_CxZ[:, None, None], scores_CxKxRxZ, _NEG_INF)
    max_CxKxR = scores_CxKxRxZ.max(-1)
    p_CxKxRxZ = jnp.exp(scores_CxKxRxZ - max_CxKxR[..., None])
    out_CxKxRxE = jnp.einsum("ckrz,czke->ckre", p_CxKxRxZ, v_CxZxKxE)
    return jnp.where(valid_C, row_C, b), max_CxKxR, p_CxKxRxZ.sum(-1), out_CxKxRxE


def paged_decode_attention(q_BxKxRxE, pages_MxZxUxE, lengths_B, table_BxI, block_pages: int):
    """`out_BxKxRxE`: softmax(q k^T / sqrt(E)) v of one query per row over the `lengths_B[b]` keys
    its pages hold (R queries per kv head; scores and sums in float32). The (row, page) pairs
    holding keys are visited `block_pages` at a time, for as many blocks as they fill; each
    block's partial maxima, sums and outputs merge into the rows' (flash-decoding). A row with
    no keys gets zeros."""
    q_BxKxRxE, pages_MxZxUxE, lengths_B, table_BxI = map(
        jnp.asarray, (q_BxKxRxE, pages_MxZxUxE, lengths_B, table_BxI)
    )
    b, k, r, e = q_BxKxRxE.shape
    z = pages_MxZxUxE.shape[1]
    pages_B = -(-lengths_B // z)
    pairs_end_B = jnp.cumsum(pages_B)
    first_page_B = pairs_end_B - pages_B

    def block(carry):
        i, max_BxKxR, sum_BxKxR, out_BxKxRxE = carry
        pair_C = i * block_pages + jnp.arange(block_pages, dtype=jnp.int32)
        row_C, m_C, s_C, o_C = _block_partials(
            q_BxKxRxE, pages_MxZxUxE, lengths_B, table_BxI, pair_C, first_page_B, pairs_end_B
        )
        new_max = max_BxKxR.at[row_C].max(m_C, mode="drop")
        old_scale = jnp.exp(max_BxKxR - new_max)
        pair_scale = jnp.exp(m_C - new_max[jnp.minimum(row_C, b - 1)])
        sum_BxKxR = (sum_BxKxR * old_scale).at[row_C].add(s_C * pair_scale, mode="drop")
        out_BxKxRxE = (
            (out_BxKxRxE * old_scale[..., None]).at[row_C].add(o_C * pair_scale[..., None], mode="drop")
        )
        return i + 1, new_max, sum_BxKxR, out_BxKxRxE

    blocks = -(-pairs_end_B[-1] // block_pages)
    init = (
        jnp.zeros((), jnp.int32),
        jnp.full((b, k, r), _NEG_INF, jnp.float32),
        jnp.zeros((b, k, r), jnp.float32),
        jnp.zeros((b, k, r, e), jnp.float32),
    )
    _, _, sum_BxKxR, out_BxKxRxE = jax.lax.while_loop(lambda c: c[0] < blocks, block, init)
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


def uses_kernel(mesh=None) -> bool:
    """Whether a decode step's attention runs the Pallas kernel: when `mesh` (default: the
    current one) is made of TPU devices, abstract ones included (an AOT compile); elsewhere
    (CPU, GPU, no mesh) the pure-JAX `paged_decode_attention`."""
    abstract = jax.sharding.get_abstract_mesh() if mesh is None else mesh.abstract_mesh
    device = getattr(abstract, "abstract_device", None)
    return not abstract.empty and device is not None and device.platform == "tpu"


def decode_step(q_BxKxRxE, k_BxKxE, v_BxKxE, pool_AxZxUxE, refs: PageRefs, layers: int):
    """`(out_BxKxRxE, pool_AxZxUxE)`: one layer's decode step over the pool of all `layers`
    layers' pages (A = L x M, layer l = `refs.layer` at pages l x M ..): row b's key and value
    written at slot `refs.write_slot_B[b]` of its page `refs.write_page_B[b]` (M: none), then its
    query attends over its `refs.lengths_B[b]` keys. Where `uses_kernel`, by the Pallas kernel
    in a `jax.shard_map` over the mesh's `tensor` axis (a Mosaic kernel is not partitioned: each
    chip writes and reads its K / T kv heads, 2K / T combined ones of the pool as it lies), or
    directly where `tensor` is manual already (a loop per device holds its heads); elsewhere by
    `paged_decode_attention`, in blocks of B (row, page) pairs."""
    m = pool_AxZxUxE.shape[0] // layers
    first = refs.layer * m
    page_B = jnp.where(refs.write_page_B < m, first + refs.write_page_B, pool_AxZxUxE.shape[0])
    table_BxI = first + refs.table_BxI
    kernel = uses_kernel()

    def step(q_BxKxRxE, k_BxKxE, v_BxKxE, pool_AxZxUxE, page_B, slot_B, lengths_B, table_BxI):
        pool_AxZxUxE = write_pages(pool_AxZxUxE, k_BxKxE, v_BxKxE, page_B, slot_B)
        if kernel:
            return kernel_decode_attention(q_BxKxRxE, pool_AxZxUxE, lengths_B, table_BxI), pool_AxZxUxE
        b = q_BxKxRxE.shape[0]
        return paged_decode_attention(q_BxKxRxE, pool_AxZxUxE, lengths_B, table_BxI, b), pool_AxZxUxE

    args = (q_BxKxRxE, k_BxKxE, v_BxKxE, pool_AxZxUxE, page_B, refs.write_slot_B, refs.lengths_B, table_BxI)
    if not kernel or "tensor" in jax.sharding.get_abstract_mesh().manual_axes:  # (a loop per device)
        return step(*args)
    heads, pool, rep = PartitionSpec(None, "tensor"), PartitionSpec(None, None, "tensor"), PartitionSpec()
    return jax.shard_map(
        step,
        in_specs=(heads, heads, heads, pool, rep, rep, rep, rep),
        out_specs=(heads, pool),
        axis_names={"tensor"},
        check_vma=False,
    )(*args)

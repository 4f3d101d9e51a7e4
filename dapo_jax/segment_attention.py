"""Causal attention within the segments of packed rows (`dapo_jax.packing`), blockwise.

Query t reads key s iff s <= t and both lie in the same segment (a run of one nonzero id along
the row; 0 is padding, which reads and is read by nothing). Packed rows hold several responses
each, so most of a row's T x T score matrix is masked: above the diagonal, and below it wherever
a key's segment ended before the query's began. `blocked_attention` cuts each row's queries and
keys into J blocks of C and lists, row by row, the pairs (query block i, key block j) that hold
an allowed score: j <= i and key block j's last segment is query block i's first or later
(segment ids increase along a row). Only those are computed, X of them at a time
(`needed_blocks`, `_work_list`): a short segment costs its own blocks, whatever the row beside
it holds. The forward pass combines a query block's key blocks by the online softmax (running
max m, normaliser l and weighted sum of values, as flash attention) and keeps, besides the
output, only each query's log-sum-exp; the backward pass (`jax.custom_vjp`) visits the same
blocks again, recomputing p = exp(s - lse) from the scores, and adds each block's dq, dk and dv
into its place. No T x T array exists in either pass, so the path is memory-bounded with or
without remat, and the result equals softmax over the allowed keys, in float32 scores, up to
float rounding.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

_NEG_INF = -1e30


class SegmentIds(NamedTuple):
    """The trainer's attention mask of packed rows, given as their segment ids (0: padding)."""

    segment_BxT: jax.Array


def needed_blocks(segment_BxT, chunk: int) -> jax.Array:
    """`needed_BxJxJ`: whether, in row b, query block i reads anything of key block j: j <= i and
    key block j's last segment is query block i's first or later (ids increase along a row, 0
    aside). Entry (i, i) is needed unless query block i is all padding."""
    b, t = segment_BxT.shape
    seg_BxJxC = segment_BxT.astype(jnp.int32).reshape(b, t // chunk, chunk)
    first_BxJ = jnp.min(jnp.where(seg_BxJxC > 0, seg_BxJxC, jnp.iinfo(jnp.int32).max), axis=-1)
    last_BxJ = jnp.max(seg_BxJxC, axis=-1)
    below_JxJ = jnp.tril(jnp.ones((t // chunk,) * 2, bool))
    return below_JxJ[None] & (last_BxJ[:, None, :] >= first_BxJ[:, :, None])


class _Work(NamedTuple):
    """The needed block pairs (`needed_blocks`), as indices of row blocks (b J + i, b J + j),
    in row and query block order, padded to whole steps of X pairs: room for every pair j <= i of
    every row, `count` of them real. (The whole list takes no shape letter: a step's X pairs do.)"""

    query_block: jax.Array
    key_block: jax.Array
    count: jax.Array


def _work_list(segment_BxT, chunk: int, per_step: int) -> _Work:
    needed_BxJxJ = needed_blocks(segment_BxT, chunk)
    b, j = needed_BxJxJ.shape[:2]
    size = -(-b * j * (j + 1) // 2 // per_step) * per_step
    row, query, key = jnp.nonzero(needed_BxJxJ, size=size, fill_value=0)
    return _Work(row * j + query, row * j + key, needed_BxJxJ.sum())


def _step_blocks(work: _Work, seg_AxC, n, per_step: int, heads_per_kv: int, blocks: int):
    """`(query_X, key_X, valid_X, allowed_Xx1xOxC)` of step n: its X pairs and which of their
    scores are allowed (same segment, not padding, key column <= query column)."""
    chunk = seg_AxC.shape[1]
    at_X = n * per_step + jnp.arange(per_step)
    query_X, key_X = work.query_block[at_X], work.key_block[at_X]
    valid_X = at_X < work.count
    col_X = lambda a_X: (a_X % blocks)[:, None] * chunk + jnp.arange(chunk)
    seg_q_XxC, seg_k_XxC = seg_AxC[query_X], seg_AxC[key_X]
    allowed_XxCxC = (
        valid_X[:, None, None]
        & (seg_q_XxC[:, :, None] == seg_k_XxC[:, None, :])
        & (seg_k_XxC[:, None, :] > 0)
        & (col_X(query_X)[:, :, None] >= col_X(key_X)[:, None, :])
    )
    x = per_step
    allowed_Xx1xOxC = jnp.broadcast_to(allowed_XxCxC[:, None, None], (x, 1, heads_per_kv, chunk, chunk))
    return query_X, key_X, valid_X, allowed_Xx1xOxC.reshape(x, 1, heads_per_kv * chunk, chunk)


def _scores(q_XxKxOxE, kT_XxKxExC, allowed_Xx1xOxC):
    scale = 1.0 / math.sqrt(q_XxKxOxE.shape[-1])
    s_XxKxOxC = jnp.einsum("xkoe,xkec->xkoc", q_XxKxOxE, kT_XxKxExC, preferred_element_type=jnp.float32)
    return jnp.where(allowed_Xx1xOxC, s_XxKxOxC * scale, _NEG_INF)


def _forward(q_AxKxOxE, kT_AxKxExC, v_AxKxCxE, seg_AxC, work: _Work, blocks: int, per_step: int, dtype):
    """`(out_AxKxOxE, lse_AxKxO)` in float32: the online softmax over each query block's needed
    key blocks, X pairs a step. Pairs of one query block in one step merge by scatter: the
    running max m first, then the sums l and acc rescaled once by exp(m_old - m_new) (at the
    block's first pair in the step) and the step's terms added at the new max."""
    a, k, o, e = q_AxKxOxE.shape
    heads_per_kv = o // seg_AxC.shape[1]

    def step(n, carry):
        max_AxKxO, sum_AxKxO, acc_AxKxOxE = carry
        query_X, key_X, valid_X, allowed_Xx1xOxC = _step_blocks(
            work, seg_AxC, n, per_step, heads_per_kv, blocks
        )
        s_XxKxOxC = _scores(q_AxKxOxE[query_X], kT_AxKxExC[key_X], allowed_Xx1xOxC)
        max_XxKxO = s_XxKxOxC.max(-1)
        p_XxKxOxC = jnp.where(allowed_Xx1xOxC, jnp.exp(s_XxKxOxC - max_XxKxO[..., None]), 0.0)
        pv_XxKxOxE = jnp.einsum(
            "xkoc,xkce->xkoe", p_XxKxOxC.astype(dtype), v_AxKxCxE[key_X], preferred_element_type=jnp.float32
        )
        new_max_AxKxO = max_AxKxO.at[query_X].max(max_XxKxO)
        old_XxKxO, new_XxKxO = max_AxKxO[query_X], new_max_AxKxO[query_X]
        first_X = valid_X & jnp.concatenate([jnp.ones(1, bool), query_X[1:] != query_X[:-1]])
        decay_XxKxO = jnp.where(first_X[:, None, None], jnp.exp(old_XxKxO - new_XxKxO), 1.0)
        weight_XxKxO = jnp.exp(max_XxKxO - new_XxKxO)
        sum_AxKxO = sum_AxKxO.at[query_X].multiply(decay_XxKxO)
        sum_AxKxO = sum_AxKxO.at[query_X].add(p_XxKxOxC.sum(-1) * weight_XxKxO)
        acc_AxKxOxE = acc_AxKxOxE.at[query_X].multiply(decay_XxKxO[..., None])
        acc_AxKxOxE = acc_AxKxOxE.at[query_X].add(pv_XxKxOxE * weight_XxKxO[..., None])
        return new_max_AxKxO, sum_AxKxO, acc_AxKxOxE

    init = (
        jnp.full((a, k, o), _NEG_INF, jnp.float32),
        jnp.zeros((a, k, o), jnp.float32),
        jnp.zeros((a, k, o, e), jnp.float32),
    )
    steps = -(-work.count // per_step)
    max_AxKxO, sum_AxKxO, acc_AxKxOxE = jax.lax.fori_loop(0, steps, step, init)
    some_AxKxO = sum_AxKxO > 0  # queries of padding read nothing: out 0
    out_AxKxOxE = acc_AxKxOxE / jnp.where(some_AxKxO, sum_AxKxO, 1.0)[..., None]
    return out_AxKxOxE, jnp.where(some_AxKxO, max_AxKxO + jnp.log(jnp.where(some_AxKxO, sum_AxKxO, 1.0)), 0.0)


def _backward(res, dout_AxKxOxE, blocks: int, per_step: int, dtype):
    """`(dq, dkT, dv)`: the same pairs, p = exp(s - lse) recomputed, ds = p (dp - rowsum(dout out)),
    and each pair's dq, dk, dv added into its query and key blocks."""
    q_AxKxOxE, kT_AxKxExC, v_AxKxCxE, seg_AxC, work, out_AxKxOxE, lse_AxKxO = res
    heads_per_kv = q_AxKxOxE.shape[2] // seg_AxC.shape[1]
    scale = 1.0 / math.sqrt(q_AxKxOxE.shape[-1])
    delta_AxKxO = jnp.sum(dout_AxKxOxE * out_AxKxOxE, axis=-1)
    dout_AxKxOxE = dout_AxKxOxE.astype(dtype)

    def step(n, carry):
        dq_AxKxOxE, dkT_AxKxExC, dv_AxKxCxE = carry
        query_X, key_X, _, allowed_Xx1xOxC = _step_blocks(work, seg_AxC, n, per_step, heads_per_kv, blocks)
        q_XxKxOxE, kT_XxKxExC, v_XxKxCxE = q_AxKxOxE[query_X], kT_AxKxExC[key_X], v_AxKxCxE[key_X]
        dout_XxKxOxE = dout_AxKxOxE[query_X]
        s_XxKxOxC = _scores(q_XxKxOxE, kT_XxKxExC, allowed_Xx1xOxC)
        p_XxKxOxC = jnp.where(allowed_Xx1xOxC, jnp.exp(s_XxKxOxC - lse_AxKxO[query_X][..., None]), 0.0)
        dot = functools.partial(jnp.einsum, preferred_element_type=jnp.float32)
        dv_XxKxCxE = dot("xkoc,xkoe->xkce", p_XxKxOxC.astype(dtype), dout_XxKxOxE)
        dp_XxKxOxC = dot("xkoe,xkce->xkoc", dout_XxKxOxE, v_XxKxCxE)
        ds_XxKxOxC = (p_XxKxOxC * (dp_XxKxOxC - delta_AxKxO[query_X][..., None]) * scale).astype(dtype)
        return (
            dq_AxKxOxE.at[query_X].add(dot("xkoc,xkec->xkoe", ds_XxKxOxC, kT_XxKxExC)),
            dkT_AxKxExC.at[key_X].add(dot("xkoc,xkoe->xkec", ds_XxKxOxC, q_XxKxOxE)),
            dv_AxKxCxE.at[key_X].add(dv_XxKxCxE),
        )

    zeros = lambda x: jnp.zeros(x.shape, jnp.float32)
    steps = -(-work.count // per_step)
    grads = jax.lax.fori_loop(0, steps, step, (zeros(q_AxKxOxE), zeros(kT_AxKxExC), zeros(v_AxKxCxE)))
    return tuple(g.astype(x.dtype) for g, x in zip(grads, (q_AxKxOxE, kT_AxKxExC, v_AxKxCxE)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _attention(q_AxKxOxE, kT_AxKxExC, v_AxKxCxE, seg_BxT, blocks: int, per_step: int, dtype):
    return _attention_fwd(q_AxKxOxE, kT_AxKxExC, v_AxKxCxE, seg_BxT, blocks, per_step, dtype)[0]


def _attention_fwd(q_AxKxOxE, kT_AxKxExC, v_AxKxCxE, seg_BxT, blocks: int, per_step: int, dtype):
    chunk = kT_AxKxExC.shape[-1]
    work = _work_list(seg_BxT, chunk, per_step)
    seg_AxC = seg_BxT.reshape(-1, chunk)
    out_AxKxOxE, lse_AxKxO = _forward(
        q_AxKxOxE, kT_AxKxExC, v_AxKxCxE, seg_AxC, work, blocks, per_step, dtype
    )
    return out_AxKxOxE, (q_AxKxOxE, kT_AxKxExC, v_AxKxCxE, seg_AxC, work, out_AxKxOxE, lse_AxKxO)


def _attention_bwd(blocks: int, per_step: int, dtype, res, dout_AxKxOxE):
    return (*_backward(res, dout_AxKxOxE, blocks, per_step, dtype), None)


_attention.defvjp(_attention_fwd, _attention_bwd)


def blocked_attention(q_BxTxKxRxE, kT_BxKxExT, v_BxKxTxE, segment_BxT, dtype, chunk: int):
    """`out_BxTxKxRxE`: attention of each query over the earlier keys of its own segment, over
    blocks of `chunk` queries and keys, only the blocks that hold an allowed score computed
    (module docstring). Queries of padding (segment 0) read nothing and give 0. The layout:
    A = B x J row blocks, each of O = R x C query rows (a block's queries of the R heads that
    share a KV head), C key columns."""
    b, t, k, r, e = q_BxTxKxRxE.shape
    j = -(-t // chunk)
    pad = j * chunk - t
    seg_BxT = jnp.pad(segment_BxT.astype(jnp.int32), ((0, 0), (0, pad)))
    q_BxTxKxRxE = jnp.pad(q_BxTxKxRxE, ((0, 0), (0, pad), (0, 0), (0, 0), (0, 0)))
    q_AxKxOxE = (
        q_BxTxKxRxE.reshape(b, j, chunk, k, r, e).transpose(0, 1, 3, 4, 2, 5).reshape(b * j, k, r * chunk, e)
    )
    kT_BxKxExT = jnp.pad(kT_BxKxExT, ((0, 0), (0, 0), (0, 0), (0, pad)))
    kT_AxKxExC = kT_BxKxExT.reshape(b, k, e, j, chunk).transpose(0, 3, 1, 2, 4).reshape(b * j, k, e, chunk)
    v_BxKxTxE = jnp.pad(v_BxKxTxE, ((0, 0), (0, 0), (0, pad), (0, 0)))
    v_AxKxCxE = v_BxKxTxE.reshape(b, k, j, chunk, e).transpose(0, 2, 1, 3, 4).reshape(b * j, k, chunk, e)
    per_step = b  # X, the block pairs computed at once: as many as the batch has rows
    out_AxKxOxE = _attention(q_AxKxOxE, kT_AxKxExC, v_AxKxCxE, seg_BxT, j, per_step, dtype)
    out_BxTxKxRxE = out_AxKxOxE.reshape(b, j, k, r, chunk, e).transpose(0, 1, 4, 2, 3, 5)
    return out_BxTxKxRxE.reshape(b, j * chunk, k, r, e)[:, :t].astype(dtype)


def _skipping(info, needed_JxJ):
    """A splash `MaskInfo` of the causal mask ([1, J, J] arrays: `block_mask` 0 skip, 1 partial,
    2 full; `data_next` the block to fetch) with the blocks of no allowed score in this row
    skipped too, marked as the kernel's own mask processing marks a skipped block (0 and 0).
    Diagonal blocks stay, so that a query of padding still reads itself (finite output)."""
    keep_1xJxJ = (needed_JxJ | jnp.eye(needed_JxJ.shape[0], dtype=bool))[None]
    zero = lambda x: jnp.where(keep_1xJxJ, x, 0).astype(x.dtype)
    return info._replace(block_mask=zero(info.block_mask), data_next=zero(info.data_next))


def splash_attention(
    q_BxTxKxRxE, kT_BxKxExT, v_BxKxTxE, segment_BxT, block: int = 512, interpret: bool = False
):
    """The TPU path: jax's splash attention Pallas kernel (a causal `MultiHeadMask`, the segment
    ids as its `SegmentIds`), run on each device of the current mesh (`jax.shard_map`: rows over
    data x fsdp, KV heads and their R query heads over tensor, as `sharding.RULES` lay them out).
    The kernel skips a block whose `MaskInfo.block_mask` is 0; its causal mask info marks the
    blocks above the diagonal so, and each row's copy (`_skipping`) also the blocks below it
    that hold no two tokens of one segment (`needed_blocks` at the kernel's block size). The
    mask infos are the kernel's scalar-prefetch operands: batched per row, jax runs the kernel
    row by row (`pallas_call`'s batching rule, an explicit loop). T must be a multiple of
    `block`. Padding (segment 0) attends within the padding of its block; no real token reads
    it. `interpret`: the Pallas interpreter (any backend; for tests)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import (  # noqa: PLC0415 (TPU only)
        splash_attention_kernel as kernels,
    )
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks  # noqa: PLC0415

    b, t, k, r, e = q_BxTxKxRxE.shape
    rows, heads = ("data", "fsdp"), "tensor"

    def local(q_bxTxkxRxE, kT_bxkxExT, v_bxkxTxE, seg_bxT):
        h = q_bxTxkxRxE.shape[2] * r  # this device's query heads
        q_bxhxTxE = q_bxTxkxRxE.transpose(0, 2, 3, 1, 4).reshape(-1, h, t, e) / math.sqrt(e)
        sizes = dict.fromkeys(
            ("block_q", "block_kv", "block_kv_compute", "block_q_dkv", "block_kv_dkv"), block
        )
        sizes.update(block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block)
        kernel = kernels.make_splash_mha(
            masks.MultiHeadMask([masks.CausalMask((t, t))] * h),
            block_sizes=kernels.BlockSizes(**sizes),
            head_shards=1,
            q_seq_shards=1,
            interpret=interpret,
        )

        def one(needed_JxJ, q, kk, v, s):
            infos = (kernel.fwd_mask_info, kernel.dq_mask_info, kernel.dkv_mask_info)
            row_kernel = kernels.SplashAttentionKernel(
                *(_skipping(info, needed_JxJ) for info in infos), **kernel.kwargs
            )
            return row_kernel(q, kk, v, segment_ids=kernels.SegmentIds(s, s))

        needed_bxJxJ = needed_blocks(seg_bxT, block)
        out_bxhxTxE = jax.vmap(one)(needed_bxJxJ, q_bxhxTxE, kT_bxkxExT.swapaxes(2, 3), v_bxkxTxE, seg_bxT)
        return out_bxhxTxE.reshape(-1, h // r, r, t, e).transpose(0, 3, 1, 2, 4)

    spec = jax.sharding.PartitionSpec
    return jax.shard_map(
        local,
        mesh=jax.sharding.get_abstract_mesh(),
        in_specs=(spec(rows, None, heads), spec(rows, heads), spec(rows, heads), spec(rows)),
        out_specs=spec(rows, None, heads),
        check_vma=False,
    )(q_BxTxKxRxE, kT_BxKxExT, v_BxKxTxE, segment_BxT.astype(jnp.int32))

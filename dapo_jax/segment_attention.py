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
    """The W needed block pairs (`needed_blocks`), as indices of row blocks (b J + i, b J + j),
    in row and query block order, padded to a multiple of the X pairs of a step: room for every
    pair j <= i of every row, `count` of them real."""

    query_W: jax.Array
    key_W: jax.Array
    count: jax.Array


def _work_list(segment_BxT, chunk: int, per_step: int) -> _Work:
    needed_BxJxJ = needed_blocks(segment_BxT, chunk)
    b, j = needed_BxJxJ.shape[:2]
    size = -(-b * j * (j + 1) // 2 // per_step) * per_step
    row_W, i_W, j_W = jnp.nonzero(needed_BxJxJ, size=size, fill_value=0)
    return _Work(row_W * j + i_W, row_W * j + j_W, needed_BxJxJ.sum())


def _step_blocks(work: _Work, seg_AxC, n, per_step: int, groups: int, blocks: int):
    """`(query_X, key_X, valid_X, allowed_Xx1xMxC)` of step n: its X pairs and which of their
    scores are allowed (same segment, not padding, key column <= query column)."""
    chunk = seg_AxC.shape[1]
    w_X = n * per_step + jnp.arange(per_step)
    query_X, key_X = work.query_W[w_X], work.key_W[w_X]
    valid_X = w_X < work.count
    col_X = lambda a_X: (a_X % blocks)[:, None] * chunk + jnp.arange(chunk)
    seg_q_XxC, seg_k_XxC = seg_AxC[query_X], seg_AxC[key_X]
    allowed_XxCxC = (
        valid_X[:, None, None]
        & (seg_q_XxC[:, :, None] == seg_k_XxC[:, None, :])
        & (seg_k_XxC[:, None, :] > 0)
        & (col_X(query_X)[:, :, None] >= col_X(key_X)[:, None, :])
    )
    x = per_step
    allowed_Xx1xMxC = jnp.broadcast_to(allowed_XxCxC[:, None, None], (x, 1, groups, chunk, chunk))
    return query_X, key_X, valid_X, allowed_Xx1xMxC.reshape(x, 1, groups * chunk, chunk)


def _scores(q_XxKxMxH, kT_XxKxHxC, allowed_Xx1xMxC):
    scale = 1.0 / math.sqrt(q_XxKxMxH.shape[-1])
    s_XxKxMxC = jnp.einsum("xkmh,xkhc->xkmc", q_XxKxMxH, kT_XxKxHxC, preferred_element_type=jnp.float32)
    return jnp.where(allowed_Xx1xMxC, s_XxKxMxC * scale, _NEG_INF)


def _forward(q_AxKxMxH, kT_AxKxHxC, v_AxKxCxH, seg_AxC, work: _Work, blocks: int, per_step: int, dtype):
    """`(out_AxKxMxH, lse_AxKxM)` in float32: the online softmax over each query block's needed
    key blocks, X pairs a step. Pairs of one query block in one step merge by scatter: the
    running max m first, then the sums l and acc rescaled once by exp(m_old - m_new) (at the
    block's first pair in the step) and the step's terms added at the new max."""
    a, k, m, h = q_AxKxMxH.shape
    groups = m // seg_AxC.shape[1]

    def step(n, carry):
        max_AxKxM, sum_AxKxM, acc_AxKxMxH = carry
        query_X, key_X, valid_X, allowed_Xx1xMxC = _step_blocks(work, seg_AxC, n, per_step, groups, blocks)
        s_XxKxMxC = _scores(q_AxKxMxH[query_X], kT_AxKxHxC[key_X], allowed_Xx1xMxC)
        max_XxKxM = s_XxKxMxC.max(-1)
        p_XxKxMxC = jnp.where(allowed_Xx1xMxC, jnp.exp(s_XxKxMxC - max_XxKxM[..., None]), 0.0)
        pv_XxKxMxH = jnp.einsum(
            "xkmc,xkch->xkmh", p_XxKxMxC.astype(dtype), v_AxKxCxH[key_X], preferred_element_type=jnp.float32
        )
        new_max_AxKxM = max_AxKxM.at[query_X].max(max_XxKxM)
        old_XxKxM, new_XxKxM = max_AxKxM[query_X], new_max_AxKxM[query_X]
        first_X = valid_X & jnp.concatenate([jnp.ones(1, bool), query_X[1:] != query_X[:-1]])
        decay_XxKxM = jnp.where(first_X[:, None, None], jnp.exp(old_XxKxM - new_XxKxM), 1.0)
        weight_XxKxM = jnp.exp(max_XxKxM - new_XxKxM)
        sum_AxKxM = sum_AxKxM.at[query_X].multiply(decay_XxKxM)
        sum_AxKxM = sum_AxKxM.at[query_X].add(p_XxKxMxC.sum(-1) * weight_XxKxM)
        acc_AxKxMxH = acc_AxKxMxH.at[query_X].multiply(decay_XxKxM[..., None])
        acc_AxKxMxH = acc_AxKxMxH.at[query_X].add(pv_XxKxMxH * weight_XxKxM[..., None])
        return new_max_AxKxM, sum_AxKxM, acc_AxKxMxH

    init = (
        jnp.full((a, k, m), _NEG_INF, jnp.float32),
        jnp.zeros((a, k, m), jnp.float32),
        jnp.zeros((a, k, m, h), jnp.float32),
    )
    steps = -(-work.count // per_step)
    max_AxKxM, sum_AxKxM, acc_AxKxMxH = jax.lax.fori_loop(0, steps, step, init)
    some_AxKxM = sum_AxKxM > 0  # queries of padding read nothing: out 0
    out_AxKxMxH = acc_AxKxMxH / jnp.where(some_AxKxM, sum_AxKxM, 1.0)[..., None]
    return out_AxKxMxH, jnp.where(some_AxKxM, max_AxKxM + jnp.log(jnp.where(some_AxKxM, sum_AxKxM, 1.0)), 0.0)


def _backward(res, dout_AxKxMxH, blocks: int, per_step: int, dtype):
    """`(dq, dkT, dv)`: the same pairs, p = exp(s - lse) recomputed, ds = p (dp - rowsum(dout out)),
    and each pair's dq, dk, dv added into its query and key blocks."""
    q_AxKxMxH, kT_AxKxHxC, v_AxKxCxH, seg_AxC, work, out_AxKxMxH, lse_AxKxM = res
    groups = q_AxKxMxH.shape[2] // seg_AxC.shape[1]
    scale = 1.0 / math.sqrt(q_AxKxMxH.shape[-1])
    delta_AxKxM = jnp.sum(dout_AxKxMxH * out_AxKxMxH, axis=-1)
    dout_AxKxMxH = dout_AxKxMxH.astype(dtype)

    def step(n, carry):
        dq_AxKxMxH, dkT_AxKxHxC, dv_AxKxCxH = carry
        query_X, key_X, _, allowed_Xx1xMxC = _step_blocks(work, seg_AxC, n, per_step, groups, blocks)
        q_XxKxMxH, kT_XxKxHxC, v_XxKxCxH = q_AxKxMxH[query_X], kT_AxKxHxC[key_X], v_AxKxCxH[key_X]
        dout_XxKxMxH = dout_AxKxMxH[query_X]
        s_XxKxMxC = _scores(q_XxKxMxH, kT_XxKxHxC, allowed_Xx1xMxC)
        p_XxKxMxC = jnp.where(allowed_Xx1xMxC, jnp.exp(s_XxKxMxC - lse_AxKxM[query_X][..., None]), 0.0)
        dot = functools.partial(jnp.einsum, preferred_element_type=jnp.float32)
        dv_XxKxCxH = dot("xkmc,xkmh->xkch", p_XxKxMxC.astype(dtype), dout_XxKxMxH)
        dp_XxKxMxC = dot("xkmh,xkch->xkmc", dout_XxKxMxH, v_XxKxCxH)
        ds_XxKxMxC = (p_XxKxMxC * (dp_XxKxMxC - delta_AxKxM[query_X][..., None]) * scale).astype(dtype)
        return (
            dq_AxKxMxH.at[query_X].add(dot("xkmc,xkhc->xkmh", ds_XxKxMxC, kT_XxKxHxC)),
            dkT_AxKxHxC.at[key_X].add(dot("xkmc,xkmh->xkhc", ds_XxKxMxC, q_XxKxMxH)),
            dv_AxKxCxH.at[key_X].add(dv_XxKxCxH),
        )

    zeros = lambda x: jnp.zeros(x.shape, jnp.float32)
    steps = -(-work.count // per_step)
    grads = jax.lax.fori_loop(0, steps, step, (zeros(q_AxKxMxH), zeros(kT_AxKxHxC), zeros(v_AxKxCxH)))
    return tuple(g.astype(x.dtype) for g, x in zip(grads, (q_AxKxMxH, kT_AxKxHxC, v_AxKxCxH)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _attention(q_AxKxMxH, kT_AxKxHxC, v_AxKxCxH, seg_BxT, blocks: int, per_step: int, dtype):
    return _attention_fwd(q_AxKxMxH, kT_AxKxHxC, v_AxKxCxH, seg_BxT, blocks, per_step, dtype)[0]


def _attention_fwd(q_AxKxMxH, kT_AxKxHxC, v_AxKxCxH, seg_BxT, blocks: int, per_step: int, dtype):
    chunk = kT_AxKxHxC.shape[-1]
    work = _work_list(seg_BxT, chunk, per_step)
    seg_AxC = seg_BxT.reshape(-1, chunk)
    out_AxKxMxH, lse_AxKxM = _forward(
        q_AxKxMxH, kT_AxKxHxC, v_AxKxCxH, seg_AxC, work, blocks, per_step, dtype
    )
    return out_AxKxMxH, (q_AxKxMxH, kT_AxKxHxC, v_AxKxCxH, seg_AxC, work, out_AxKxMxH, lse_AxKxM)


def _attention_bwd(blocks: int, per_step: int, dtype, res, dout_AxKxMxH):
    return (*_backward(res, dout_AxKxMxH, blocks, per_step, dtype), None)


_attention.defvjp(_attention_fwd, _attention_bwd)


def blocked_attention(q_BxTxKxGxH, kT_BxKxHxT, v_BxKxTxH, segment_BxT, dtype, chunk: int):
    """`out_BxTxKxGxH`: attention of each query over the earlier keys of its own segment, over
    blocks of `chunk` queries and keys, only the blocks that hold an allowed score computed
    (module docstring). Queries of padding (segment 0) read nothing and give 0. The layout:
    A = B x J row blocks, each of M = G x C query rows (a block's queries of the G heads that
    share a KV head), C key columns."""
    b, t, k, g, h = q_BxTxKxGxH.shape
    j = -(-t // chunk)
    pad = j * chunk - t
    seg_BxT = jnp.pad(segment_BxT.astype(jnp.int32), ((0, 0), (0, pad)))
    q_BxTxKxGxH = jnp.pad(q_BxTxKxGxH, ((0, 0), (0, pad), (0, 0), (0, 0), (0, 0)))
    q_AxKxMxH = (
        q_BxTxKxGxH.reshape(b, j, chunk, k, g, h).transpose(0, 1, 3, 4, 2, 5).reshape(b * j, k, g * chunk, h)
    )
    kT_BxKxHxT = jnp.pad(kT_BxKxHxT, ((0, 0), (0, 0), (0, 0), (0, pad)))
    kT_AxKxHxC = kT_BxKxHxT.reshape(b, k, h, j, chunk).transpose(0, 3, 1, 2, 4).reshape(b * j, k, h, chunk)
    v_BxKxTxH = jnp.pad(v_BxKxTxH, ((0, 0), (0, 0), (0, pad), (0, 0)))
    v_AxKxCxH = v_BxKxTxH.reshape(b, k, j, chunk, h).transpose(0, 2, 1, 3, 4).reshape(b * j, k, chunk, h)
    per_step = b  # X, the block pairs computed at once: as many as the batch has rows
    out_AxKxMxH = _attention(q_AxKxMxH, kT_AxKxHxC, v_AxKxCxH, seg_BxT, j, per_step, dtype)
    out_BxTxKxGxH = out_AxKxMxH.reshape(b, j, k, g, chunk, h).transpose(0, 1, 4, 2, 3, 5)
    return out_BxTxKxGxH.reshape(b, j * chunk, k, g, h)[:, :t].astype(dtype)


def _skipping(info, needed_JxJ):
    """A splash `MaskInfo` of the causal mask ([1, J, J] arrays: `block_mask` 0 skip, 1 partial,
    2 full; `data_next` the block to fetch) with the blocks of no allowed score in this row
    skipped too, marked as the kernel's own mask processing marks a skipped block (0 and 0).
    Diagonal blocks stay, so that a query of padding still reads itself (finite output)."""
    keep_1xJxJ = (needed_JxJ | jnp.eye(needed_JxJ.shape[0], dtype=bool))[None]
    zero = lambda x: jnp.where(keep_1xJxJ, x, 0).astype(x.dtype)
    return info._replace(block_mask=zero(info.block_mask), data_next=zero(info.data_next))


def splash_attention(
    q_BxTxKxGxH, kT_BxKxHxT, v_BxKxTxH, segment_BxT, block: int = 512, interpret: bool = False
):
    """The TPU path: jax's splash attention Pallas kernel (a causal `MultiHeadMask`, the segment
    ids as its `SegmentIds`), run on each device of the current mesh (`jax.shard_map`: rows over
    data x fsdp, KV heads and their G query heads over tensor, as `sharding.RULES` lay them out).
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

    b, t, k, g, h = q_BxTxKxGxH.shape
    rows, heads = ("data", "fsdp"), "tensor"

    def local(q_bxTxkxGxH, kT_bxkxHxT, v_bxkxTxH, seg_bxT):
        n = q_bxTxkxGxH.shape[2] * g
        q_bxNxTxH = q_bxTxkxGxH.transpose(0, 2, 3, 1, 4).reshape(-1, n, t, h) / math.sqrt(h)
        sizes = dict.fromkeys(
            ("block_q", "block_kv", "block_kv_compute", "block_q_dkv", "block_kv_dkv"), block
        )
        sizes.update(block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block)
        kernel = kernels.make_splash_mha(
            masks.MultiHeadMask([masks.CausalMask((t, t))] * n),
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
        out_bxNxTxH = jax.vmap(one)(needed_bxJxJ, q_bxNxTxH, kT_bxkxHxT.swapaxes(2, 3), v_bxkxTxH, seg_bxT)
        return out_bxNxTxH.reshape(-1, n // g, g, t, h).transpose(0, 3, 1, 2, 4)

    spec = jax.sharding.PartitionSpec
    return jax.shard_map(
        local,
        mesh=jax.sharding.get_abstract_mesh(),
        in_specs=(spec(rows, None, heads), spec(rows, heads), spec(rows, heads), spec(rows)),
        out_specs=spec(rows, None, heads),
        check_vma=False,
    )(q_BxTxKxGxH, kT_BxKxHxT, v_BxKxTxH, segment_BxT.astype(jnp.int32))

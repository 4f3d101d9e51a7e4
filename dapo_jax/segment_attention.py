"""Causal attention within the segments of packed rows (`dapo_jax.packing`), blockwise.

Query t reads key s iff s <= t and both lie in the same segment (a run of one nonzero id along
the row; 0 is padding, which reads and is read by nothing). Packed rows hold several responses
each, so most of a row's T x T score matrix is masked: above the diagonal, and below it wherever
a key's segment ended before the query's began. `blocked_attention` cuts queries and keys into
blocks of C and visits, for query block i, key blocks j <= i only, each through a `lax.cond`
that skips it when no row of the batch has a query of block i and a key of block j in one
segment (segment ids increase along a row, so that is: key block j's last segment is before
query block i's first). The blocks it visits are combined by the online softmax (running max
m, normaliser l and weighted sum of values, as flash attention): the result equals softmax over
the allowed keys, in float32 scores, up to float rounding. Under remat the same code runs again
in the backward pass, skipping the same blocks.
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


def _grouped(q_BxCxKxGxH):
    """[B, C, K, G, H] -> [B x K, G x C, H]: one 3-d batched dot per block (see model.grouped_attention)."""
    b, c, k, g, h = q_BxCxKxGxH.shape
    return q_BxCxKxGxH.transpose(0, 2, 3, 1, 4).reshape(b * k, g * c, h)


def _block_update(carry, *, q_RxMxH, kT_RxHxC, v_RxCxH, allowed_BxCxC, groups: int, dtype):
    """The online softmax's (m, l, acc) after one more block of keys."""
    m_RxM, l_RxM, acc_RxMxH = carry
    r, mq, _ = q_RxMxH.shape
    b, c = allowed_BxCxC.shape[:2]
    scale = 1.0 / math.sqrt(q_RxMxH.shape[-1])
    s_RxMxC = jnp.einsum("rmh,rhs->rms", q_RxMxH, kT_RxHxC, preferred_element_type=jnp.float32) * scale
    allowed_RxMxC = jnp.broadcast_to(allowed_BxCxC[:, None, None], (b, r // b, groups, c, c)).reshape(
        r, mq, c
    )
    s_RxMxC = jnp.where(allowed_RxMxC, s_RxMxC, _NEG_INF)
    m_new_RxM = jnp.maximum(m_RxM, s_RxMxC.max(axis=-1))
    p_RxMxC = jnp.where(allowed_RxMxC, jnp.exp(s_RxMxC - m_new_RxM[..., None]), 0.0)
    decay_RxM = jnp.exp(m_RxM - m_new_RxM)
    pv_RxMxH = jnp.einsum("rms,rsh->rmh", p_RxMxC.astype(dtype), v_RxCxH, preferred_element_type=jnp.float32)
    return m_new_RxM, l_RxM * decay_RxM + p_RxMxC.sum(-1), acc_RxMxH * decay_RxM[..., None] + pv_RxMxH


def needed_blocks(segment_BxT, chunk: int) -> jax.Array:
    """`needed_NxN`: whether query block i reads anything of key block j (j <= i) in some row:
    key block j's last segment is query block i's first (ids increase along a row, 0 aside).
    Entry (i, i) is needed unless block i is all padding; entries above the diagonal never are."""
    b, t = segment_BxT.shape
    seg_NxBxC = segment_BxT.astype(jnp.int32).reshape(b, t // chunk, chunk).swapaxes(0, 1)
    first_NxB = jnp.min(jnp.where(seg_NxBxC > 0, seg_NxBxC, jnp.iinfo(jnp.int32).max), axis=-1)
    last_NxB = jnp.max(seg_NxBxC, axis=-1)
    below_NxN = jnp.tril(jnp.ones((t // chunk,) * 2, bool))
    return below_NxN & jnp.any(last_NxB[None, :, :] >= first_NxB[:, None, :], axis=-1)


def _query_block(
    i: int, chunk: int, groups: int, dtype, q_BxCxKxGxH, kT_BxKxHxT, v_BxKxTxH, seg_BxT, needed_N
):
    """Query block i's output `out_BxCxKxGxH` over key blocks 0..i (those of `needed_N` only)."""
    b, c, k, g, h = q_BxCxKxGxH.shape
    q_RxMxH = _grouped(q_BxCxKxGxH)
    seg_q_BxC = seg_BxT[:, i * chunk : (i + 1) * chunk]
    carry = (
        jnp.full((b * k, g * c), _NEG_INF, jnp.float32),
        jnp.zeros((b * k, g * c), jnp.float32),
        jnp.zeros((b * k, g * c, h), jnp.float32),
    )
    for j in range(i + 1):
        keys = slice(j * chunk, (j + 1) * chunk)
        seg_k_BxC = seg_BxT[:, keys]
        allowed_BxCxC = (seg_q_BxC[:, :, None] == seg_k_BxC[:, None, :]) & (seg_k_BxC[:, None, :] > 0)
        if i == j:
            allowed_BxCxC = allowed_BxCxC & jnp.tril(jnp.ones((chunk, chunk), bool))
        kT_RxHxC = kT_BxKxHxT[..., keys].reshape(b * k, h, chunk)
        v_RxCxH = v_BxKxTxH[:, :, keys].reshape(b * k, chunk, h)
        update = functools.partial(
            _block_update,
            q_RxMxH=q_RxMxH,
            kT_RxHxC=kT_RxHxC,
            v_RxCxH=v_RxCxH,
            allowed_BxCxC=allowed_BxCxC,
            groups=groups,
            dtype=dtype,
        )
        carry = update(carry) if i == j else jax.lax.cond(needed_N[j], update, lambda c: c, carry)
    _, l_RxM, acc_RxMxH = carry
    out_RxMxH = acc_RxMxH / jnp.where(l_RxM > 0, l_RxM, 1.0)[..., None]
    return out_RxMxH.reshape(b, k, g, c, h).transpose(0, 3, 1, 2, 4)


def blocked_attention(
    q_BxTxKxGxH, kT_BxKxHxT, v_BxKxTxH, segment_BxT, dtype, chunk: int, remat: bool = False
):
    """`out_BxTxKxGxH`: attention of each query over the earlier keys of its own segment, over
    blocks of `chunk` queries and keys, the blocks no query can read skipped (module docstring).
    Queries of padding (segment 0) read nothing and give 0. With `remat` each query block is
    rematerialised in the backward pass (`jax.checkpoint`): its scores are not kept from the
    forward, so one block's C x T of them are alive at a time, as `model.chunked_attention`'s."""
    b, t, k, g, h = q_BxTxKxGxH.shape
    n = -(-t // chunk)
    pad = n * chunk - t
    seg_BxT = jnp.pad(segment_BxT.astype(jnp.int32), ((0, 0), (0, pad)))
    q_BxTxKxGxH = jnp.pad(q_BxTxKxGxH, ((0, 0), (0, pad), (0, 0), (0, 0), (0, 0)))
    kT_BxKxHxT = jnp.pad(kT_BxKxHxT, ((0, 0), (0, 0), (0, 0), (0, pad)))
    v_BxKxTxH = jnp.pad(v_BxKxTxH, ((0, 0), (0, 0), (0, pad), (0, 0)))
    needed_NxN = needed_blocks(seg_BxT, chunk)
    blocks = []
    for i in range(n):
        one = functools.partial(_query_block, i, chunk, g, dtype)
        one = jax.checkpoint(one) if remat else one
        q_BxCxKxGxH = q_BxTxKxGxH[:, i * chunk : (i + 1) * chunk]
        blocks.append(one(q_BxCxKxGxH, kT_BxKxHxT, v_BxKxTxH, seg_BxT, needed_NxN[i]))
    return jnp.concatenate(blocks, axis=1)[:, :t].astype(dtype)


def splash_attention(
    q_BxTxKxGxH, kT_BxKxHxT, v_BxKxTxH, segment_BxT, block: int = 512, interpret: bool = False
):
    """The TPU path: jax's splash attention Pallas kernel (a causal `MultiHeadMask`, the segment
    ids as its `SegmentIds`: blocks above the diagonal skipped, other segments masked), run on
    each device of the current mesh (`jax.shard_map`: rows over data x fsdp, KV heads and their
    G query heads over tensor, as `sharding.RULES` lay them out). T must be a multiple of
    `block`. Padding (segment 0) attends within the padding; no real token reads it.
    `interpret`: the Pallas interpreter (any backend; for tests)."""
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
        one = lambda q, kk, v, s: kernel(q, kk, v, segment_ids=kernels.SegmentIds(s, s))
        out_bxNxTxH = jax.vmap(one)(q_bxNxTxH, kT_bxkxHxT.swapaxes(2, 3), v_bxkxTxH, seg_bxT)
        return out_bxNxTxH.reshape(-1, n // g, g, t, h).transpose(0, 3, 1, 2, 4)

    spec = jax.sharding.PartitionSpec
    return jax.shard_map(
        local,
        mesh=jax.sharding.get_abstract_mesh(),
        in_specs=(spec(rows, None, heads), spec(rows, heads), spec(rows, heads), spec(rows)),
        out_specs=spec(rows, None, heads),
        check_vma=False,
    )(q_BxTxKxGxH, kT_BxKxHxT, v_BxKxTxH, segment_BxT.astype(jnp.int32))

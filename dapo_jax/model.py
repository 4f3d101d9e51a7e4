"""The decoder-only transformer of Qwen2/Qwen2.5, Qwen3 (dense) and Llama, in Flax linen.

Token embedding, RoPE, grouped-query attention with optional q/k/v bias (Qwen2) and optional
RMSNorm of each query and key head before RoPE (Qwen3), RMSNorm, SwiGLU MLP, tied or untied LM
head. Parameter names mirror Hugging Face's so that `hf_io` maps them one to one. Every parameter
and the main activations carry logical axis names (`sharding.RULES` maps them onto the mesh). The
model knows nothing of RL.

Attention takes an explicit boolean mask `attn_BxTxS` (query t may read key slot s), or in the
trainer's pass over packed rows their `segment_attention.SegmentIds`. Without a cache
the keys are the T input tokens (S = T): the trainer's teacher-forced pass. With a cache (`KVCache`,
one per layer) row b's T new keys and values are written at its slot `cache_index_B[b]` (a scalar:
every row's) and the queries read all S cache slots: `grouped_attention` for a prefill (T > 1),
`decode_attention` for a decode step (T = 1). With a paged cache (one pool of every layer's pages,
`paged_attention`) and `cache_index_B` a `PageRefs`, a decode step writes each row's key and value
where the refs say and reads only the pages its table names, up to its length
(`paged_attention.decode_step`: the Pallas kernel on TPU); the pool is threaded through the layers.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from dapo_jax import paged_attention
from dapo_jax.paged_attention import PageRefs
from dapo_jax.segment_attention import SegmentIds, blocked_attention, splash_attention

_NEG_INF = -1e30  # finite, so that a fully masked (padding) query row stays NaN-free
# A block of multi-token attention holds at most this many scores a row and query head (f32: 128 MiB)
BLOCK_SCORES = 2**25
# Queries and keys per block of packed rows' attention off TPU (`blocked_attention`), whose block
# pairs that no segment needs are skipped (the splash kernel's on TPU: 512). Blocks of 64: the
# faster update on the 2-core CPU than one block or 32 (experiments/README.md).
SEGMENT_BLOCK = 64
# The jax.checkpoint_policies names that are policies themselves, not factories of one
# (checkpoint_dots and checkpoint_dots_with_no_batch_dims are aliases of two of them)
REMAT_POLICIES = (
    "nothing_saveable",
    "dots_with_no_batch_dims_saveable",
    "dots_saveable",
    "everything_saveable",
)


def block_size(t: int, per_item: int, budget: int) -> int:
    """C, the items per block of an axis of T items that each take `per_item` elements: all T
    when T x per_item <= budget, else the largest power of two with C x per_item <= budget (1 at
    least)."""
    if t * per_item <= budget:
        return t
    return 1 << max((budget // per_item).bit_length() - 1, 0)


def attention_block(t: int, s: int) -> int:
    """C, the queries per block of a multi-token attention of T queries over S keys (S = T without
    a cache): all T when a row's T x S scores a head fit `BLOCK_SCORES` (2^25), else the largest
    power of two with C x S <= 2^25. At Qwen2.5-32B's T = S = 2048 + 20480 = 22,528 that is
    1024 (2^25 / 22,528 = 1489.5): a layer's scores 1024 x 22,528 a block, not 22,528^2."""
    return block_size(t, s, BLOCK_SCORES)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture and numerics; `hf_model_config.config_from_hf` builds it from a config.json."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, float], ...] | None = None  # llama3 rope: sorted (key, value)
    qkv_bias: bool = False  # True for Qwen2
    qk_norm: bool = False  # True for Qwen3: RMSNorm over each q and k head before RoPE
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    dtype: str = "bfloat16"  # compute dtype
    param_dtype: str = "float32"
    # each decoder layer rematerialised in the backward pass, keeping what this jax.checkpoint_policies
    # policy saves (one of REMAT_POLICIES); None: no rematerialisation
    remat: str | None = None
    scan_layers: bool = False  # one compiled layer body (nn.scan), params stacked on "layers"
    transposed_keys: bool = False  # cached keys as [B, K, E, S] (`KVCache`), for XLA:CPU's decode

    @property
    def compute_dtype(self):
        return jnp.dtype(self.dtype)

    @property
    def weight_dtype(self):
        return jnp.dtype(self.param_dtype)

    def num_params(self) -> int:
        d, f, v, e = self.hidden_size, self.intermediate_size, self.vocab_size, self.head_dim
        attn = d * e * (2 * self.num_heads + 2 * self.num_kv_heads)
        attn += e * (self.num_heads + 2 * self.num_kv_heads) if self.qkv_bias else 0
        attn += 2 * e if self.qk_norm else 0
        layer = attn + 3 * d * f + 2 * d + (2 * f + d if self.mlp_bias else 0)
        return v * d * (1 if self.tie_word_embeddings else 2) + self.num_layers * layer + d


class KVCache(NamedTuple):
    """One layer's cache of S slots: keys `k_BxKxSxE` (with `transposed_keys`, `kT_BxKxExS`) and
    values `v_BxKxSxE`, slot s of row b holding the key and value of the token that row wrote at
    s. Transposed keys let a decode step's q.k sum over E along a non-minor axis, which XLA:CPU
    runs faster (figures: experiments/README.md)."""

    k: jax.Array
    v: jax.Array


def init_cache(config: ModelConfig, batch: int, length: int) -> list[KVCache] | KVCache:
    """Zeroed caches of `length` slots in the compute dtype: one per layer, or with `scan_layers`
    one KVCache whose arrays are stacked on a leading layer axis."""
    lead = (config.num_layers,) if config.scan_layers else ()
    v_shape = (*lead, batch, config.num_kv_heads, length, config.head_dim)
    k_shape = v_shape[:-2] + v_shape[-2:][::-1] if config.transposed_keys else v_shape
    zeros = lambda: KVCache(
        jnp.zeros(k_shape, config.compute_dtype), jnp.zeros(v_shape, config.compute_dtype)
    )
    return zeros() if config.scan_layers else [zeros() for _ in range(config.num_layers)]


def cache_slot_axes(config: ModelConfig) -> KVCache:
    """The slot axis S of a layer's key and value arrays (behind any leading layer axis)."""
    return KVCache(k=3 if config.transposed_keys else 2, v=2)


def cache_layer_axes(caches) -> int:
    """Leading layer axes of a cache's arrays: 1 for a stacked (scanned) cache, 0 for a list."""
    return 1 if isinstance(caches, KVCache) else 0


def cache_slots(caches) -> int:
    """S, the slots each cache holds (per-layer caches or one stacked KVCache)."""
    return (caches if isinstance(caches, KVCache) else caches[0]).v.shape[-2]


def write_cache(cache: KVCache, k_BxKxTxE, v_BxKxTxE, index_B, transposed_keys: bool) -> KVCache:
    """`cache` with row b's T new keys and values at slots index_B[b] .. index_B[b] + T - 1. A
    scalar `index_B` is every row's slot (the fixed batch's decode): one in-place slice update,
    where per-row slots are a scatter, slow on XLA:CPU for transposed keys' strided slots."""
    shared = jnp.ndim(index_B) == 0

    def put(c, x, slot_axis):  # slot_axis: of one row's [K, S, E] or [K, E, S]
        at = lambda i, lead: (0,) * lead + tuple(i if a == slot_axis else 0 for a in range(3))
        if shared:
            return jax.lax.dynamic_update_slice(c, x.astype(c.dtype), at(index_B, 1))
        update = lambda c_row, x_row, i: jax.lax.dynamic_update_slice(c_row, x_row, at(i, 0))
        return jax.vmap(update)(c, x.astype(c.dtype), index_B)

    if transposed_keys:
        return KVCache(put(cache.k, k_BxKxTxE.swapaxes(2, 3), 2), put(cache.v, v_BxKxTxE, 1))
    return KVCache(put(cache.k, k_BxKxTxE, 1), put(cache.v, v_BxKxTxE, 1))


def positions_from_mask(mask_BxT: jax.Array) -> jax.Array:
    """Position ids of left- or right-padded rows: 0 at each row's first real token."""
    return jnp.maximum(jnp.cumsum(mask_BxT.astype(jnp.int32), axis=-1) - 1, 0)


def causal_attention_mask(mask_BxT: jax.Array) -> jax.Array:
    """`attn_BxTxT`: query t reads key s iff s <= t and s is a real token."""
    t = mask_BxT.shape[-1]
    causal_TxT = jnp.tril(jnp.ones((t, t), bool))
    return causal_TxT[None] & mask_BxT[:, None, :].astype(bool)


def segment_positions(segment_BxT: jax.Array) -> jax.Array:
    """Position ids of packed rows: t minus the first column of the segment (a run of one id
    along the row, 0 for padding) that token t belongs to."""
    t = segment_BxT.shape[-1]
    cols_T = jnp.arange(t)
    before_BxT = jnp.pad(segment_BxT[:, :-1], ((0, 0), (1, 0)), constant_values=-1)
    first_BxT = jax.lax.cummax(jnp.where(segment_BxT != before_BxT, cols_T, 0), axis=1)
    return cols_T - first_BxT


def segment_attention_mask(segment_BxT: jax.Array) -> jax.Array:
    """`attn_BxTxT` of packed rows: query t reads key s iff s <= t and both lie in the same
    segment (padding, segment 0, reads and is read by nothing)."""
    t = segment_BxT.shape[-1]
    same_BxTxT = segment_BxT[:, :, None] == segment_BxT[:, None, :]
    return jnp.tril(jnp.ones((t, t), bool))[None] & same_BxTxT & (segment_BxT[:, None, :] > 0)


def teacher_forced_inputs(mask_BxT: jax.Array) -> tuple[jax.Array, jax.Array | SegmentIds]:
    """`(positions_BxT, attention mask)` of a trainer's pass: `attn_BxTxT` of a boolean mask of
    padded rows, or the `SegmentIds` of packed rows (`dapo_jax.packing`) given as int ids."""
    if jnp.issubdtype(mask_BxT.dtype, jnp.integer):
        return segment_positions(mask_BxT), SegmentIds(mask_BxT)
    return positions_from_mask(mask_BxT), causal_attention_mask(mask_BxT)


def rope_inverse_frequencies(config: ModelConfig) -> jax.Array:
    """theta^(-2i/d) for i < d/2, with Llama 3's frequency-dependent rescaling when configured."""
    e = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (jnp.arange(0, e, 2, dtype=jnp.float32) / e))
    if config.rope_scaling is None:
        return inv_freq
    s = dict(config.rope_scaling)
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = jnp.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return jnp.where(medium, smoothed, scaled)


class Rope(NamedTuple):
    """cos and sin of the rotary angles, `[B, T, 1, E/2]`, computed once and shared by the layers."""

    cos: jax.Array
    sin: jax.Array


def rope_tables(positions_BxT: jax.Array, config: ModelConfig, bound: int) -> Rope:
    """cos and sin of the angles position * theta^(-2i/d) of every token, for positions in
    [0, bound): looked up in the table of all `bound` positions, which XLA computes once (or
    folds to a constant). Computed per token instead, XLA:CPU fuses the cos and sin into each use
    and evaluates them again for every element of q and k, in every layer. A position outside
    [0, bound) reads NaN."""
    angles_SxE2 = jnp.arange(bound, dtype=jnp.float32)[:, None] * rope_inverse_frequencies(config)
    take = lambda table_SxE2: jnp.take(table_SxE2, positions_BxT, axis=0, mode="fill", fill_value=jnp.nan)
    return Rope(take(jnp.cos(angles_SxE2))[:, :, None, :], take(jnp.sin(angles_SxE2))[:, :, None, :])


def apply_rope(x_BxTxHxE: jax.Array, rope: Rope) -> jax.Array:
    """Rotary embedding in the half-split layout that Hugging Face checkpoints expect."""
    x1, x2 = jnp.split(x_BxTxHxE.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * rope.cos - x2 * rope.sin, x2 * rope.cos + x1 * rope.sin], axis=-1)
    return out.astype(x_BxTxHxE.dtype)


def grouped_attention(q_BxTxKxRxE, kT_BxKxExS, v_BxKxSxE, attn_BxTxS, dtype):
    """softmax(q k^T / sqrt(E), masked) v for R query heads per kv head and T queries (a
    teacher-forced pass or a prefill); scores in float32. Two 3-d batched dots over A = K x B rows
    of O = R x T queries (`q_AxOxE`): XLA:CPU has no kernel for a bf16 dot with f32 accumulation
    and two batch dimensions (the 5-d einsum), and runs the 3-d one. K leads A, so that KV heads
    split over the tensor axis stay split in A when the rows are not (a data shard's prefill): B
    x K made XLA hold every head's scores on each tensor shard (experiments/README.md)."""
    b, t, k, r, e = q_BxTxKxRxE.shape
    scale = 1.0 / math.sqrt(e)
    q_AxOxE = q_BxTxKxRxE.transpose(2, 0, 3, 1, 4).reshape(k * b, r * t, e)
    kT_AxExS = kT_BxKxExS.swapaxes(0, 1).reshape(k * b, e, -1)
    scores_AxOxS = jnp.einsum("aoe,aes->aos", q_AxOxE, kT_AxExS, preferred_element_type=jnp.float32)
    scores_KxBxRxTxS = scores_AxOxS.reshape(k, b, r, t, -1) * scale
    scores = jnp.where(attn_BxTxS[None, :, None], scores_KxBxRxTxS, _NEG_INF)
    probs_AxOxS = jax.nn.softmax(scores, axis=-1).astype(dtype).reshape(k * b, r * t, -1)
    out_AxOxE = jnp.einsum("aos,ase->aoe", probs_AxOxS, v_BxKxSxE.swapaxes(0, 1).reshape(k * b, -1, e))
    return out_AxOxE.reshape(k, b, r, t, e).transpose(1, 3, 0, 2, 4)


def decode_attention(q_BxKxRxE, cache: KVCache, attn_BxS, dtype, transposed_keys: bool):
    """`out_BxKxRxE`: one query per row (a decode step) over the S cache slots it may read;
    scores in float32. Written as broadcast multiplies and sums, not dots: as dots they become
    B x K matrix-vector products of R rows (figures: experiments/README.md)."""
    scale = 1.0 / math.sqrt(q_BxKxRxE.shape[-1])
    q32_BxKxRxE = q_BxKxRxE.astype(jnp.float32)
    if transposed_keys:
        kT_BxKx1xExS = cache.k[:, :, None].astype(jnp.float32)
        scores_BxKxRxS = jnp.sum(q32_BxKxRxE[..., None] * kT_BxKx1xExS, -2) * scale
    else:
        k_BxKx1xSxE = cache.k[:, :, None].astype(jnp.float32)
        scores_BxKxRxS = jnp.sum(q32_BxKxRxE[:, :, :, None, :] * k_BxKx1xSxE, -1) * scale
    scores_BxKxRxS = jnp.where(attn_BxS[:, None, None], scores_BxKxRxS, _NEG_INF)
    probs_BxKxRxS = jax.nn.softmax(scores_BxKxRxS, axis=-1).astype(dtype)
    return jnp.sum(probs_BxKxRxS[..., None] * cache.v[:, :, None], -2)


def chunked_attention(q_BxTxKxRxE, keys, v_BxKxSxE, attn_BxTxS, dtype, chunk: int, causal_prefix: bool):
    """`grouped_attention` over blocks of `chunk` queries (one block when T <= chunk).

    By default the blocks run one after another (`lax.map`), each rematerialised in the backward
    pass: one block's B x K x R x C x S scores are alive at a time, not all T rows of them (a
    layer's f32 scores at T = S = 20k are ~64 GB per sequence for Qwen2.5-32B). With
    `causal_prefix` (only for a teacher-forced pass, where query t is key t and reads keys s <= t)
    block i reads only its keys [0, (i + 1) x chunk), the others being masked: about half of the
    T x S scores, their softmax and their gradients are never computed, but the blocks are
    unrolled and XLA may keep all of them alive at once. A fully masked query row (left padding)
    then averages the values of its block's keys, not of all S: padding rows stay finite, and no
    real token reads them."""
    b, t, k, r, e = q_BxTxKxRxE.shape
    if t <= chunk:
        return grouped_attention(q_BxTxKxRxE, keys, v_BxKxSxE, attn_BxTxS, dtype)
    if causal_prefix:
        blocks = [(start, min(start + chunk, t)) for start in range(0, t, chunk)]
        return jnp.concatenate(
            [
                grouped_attention(
                    q_BxTxKxRxE[:, start:stop],
                    keys[..., :stop],
                    v_BxKxSxE[:, :, :stop],
                    attn_BxTxS[:, start:stop, :stop],
                    dtype,
                )
                for start, stop in blocks
            ],
            axis=1,
        )
    j = -(-t // chunk)
    pad = ((0, 0), (0, j * chunk - t))  # padded queries read no key; their rows are dropped
    q_JxBxCxKxRxE = jnp.pad(q_BxTxKxRxE, pad + ((0, 0),) * 3).reshape(b, j, chunk, k, r, e).swapaxes(0, 1)
    attn_JxBxCxS = jnp.pad(attn_BxTxS, pad + ((0, 0),)).reshape(b, j, chunk, -1).swapaxes(0, 1)
    block = jax.checkpoint(lambda q_attn: grouped_attention(q_attn[0], keys, v_BxKxSxE, q_attn[1], dtype))
    out_JxBxCxKxRxE = jax.lax.map(block, (q_JxBxCxKxRxE, attn_JxBxCxS))
    return out_JxBxCxKxRxE.swapaxes(0, 1).reshape(b, j * chunk, k, r, e)[:, :t]


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def matmul(x, w, precision=None):
    """`x @ w` over the last axis of x (x: any leading axes, then the layer's input features; w:
    input by output features; of any rank, so no shape letters), differentiated by hand: dx =
    g W^T and dW = x^T g, the latter one dot over all leading axes flattened into tokens.
    Autodiff gives the same numbers, but XLA:CPU then materialises a transposed copy of x or g
    fused with their elementwise producers before each weight-gradient dot, about half of the
    backward pass's time (figures: experiments/README.md)."""
    return jax.lax.dot_general(x, w, (((x.ndim - 1,), (0,)), ((), ())), precision)


def _matmul_fwd(x, w, precision):
    return matmul(x, w, precision), (x, w)


def _matmul_bwd(precision, residuals, g):
    x, w = residuals
    dx = jax.lax.dot_general(g, w, (((g.ndim - 1,), (1,)), ((), ())), precision)
    x_tokens, g_tokens = x.reshape(-1, x.shape[-1]), g.reshape(-1, g.shape[-1])
    dw = jax.lax.dot_general(x_tokens, g_tokens, (((0,), (0,)), ((), ())), precision)
    return dx.astype(x.dtype), dw.astype(w.dtype)


matmul.defvjp(_matmul_fwd, _matmul_bwd)


def _dense_dot(x, w, dimension_numbers, precision=None, preferred_element_type=None):
    """The `dot_general` nn.Dense calls: (((x.ndim - 1,), (0,)), ((), ())), as `matmul`."""
    if dimension_numbers != (((x.ndim - 1,), (0,)), ((), ())) or preferred_element_type is not None:
        raise ValueError(f"matmul serves nn.Dense's dot only, got {dimension_numbers}")
    return matmul(x, w, precision)


def _dense(config, features, axes, use_bias, name):
    return nn.Dense(
        features,
        use_bias=use_bias,
        dtype=config.compute_dtype,
        param_dtype=config.weight_dtype,
        kernel_init=nn.with_logical_partitioning(nn.initializers.normal(0.02), axes),
        bias_init=nn.with_logical_partitioning(nn.initializers.zeros, axes[-1:]),
        dot_general=_dense_dot,
        name=name,
    )


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * scale over the last axis, computed in float32; `axis` is the
    scale's logical axis name."""

    eps: float
    dtype: jnp.dtype
    param_dtype: jnp.dtype
    axis: str = "norm"

    @nn.compact
    def __call__(self, x):
        scale = self.param(
            "scale",
            nn.with_logical_partitioning(nn.initializers.ones, (self.axis,)),
            (x.shape[-1],),
            self.param_dtype,
        )
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return scale.astype(self.dtype) * x32.astype(self.dtype)


class Attention(nn.Module):
    """Grouped-query attention: H query heads share K = num_kv_heads key/value heads. With
    `qk_norm` each query and key head is RMS-normalised (one scale of E entries for all query
    heads, one for all key heads) before RoPE, so the cache holds normalised, rotated keys."""

    config: ModelConfig

    @nn.compact
    def __call__(self, x_BxTxD, rope: Rope, attn_BxTxS, cache: KVCache | None, cache_index_B):
        c = self.config
        b, t, _ = x_BxTxD.shape
        h, k, e = c.num_heads, c.num_kv_heads, c.head_dim
        q = _dense(c, h * e, ("embed", "heads"), c.qkv_bias, "q_proj")(x_BxTxD)
        key = _dense(c, k * e, ("embed", "kv_heads"), c.qkv_bias, "k_proj")(x_BxTxD)
        val = _dense(c, k * e, ("embed", "kv_heads"), c.qkv_bias, "v_proj")(x_BxTxD)
        q_BxTxHxE, k_BxTxKxE = q.reshape(b, t, h, e), key.reshape(b, t, k, e)
        if c.qk_norm:
            norm = lambda name: RMSNorm(
                c.rms_norm_eps, c.compute_dtype, c.weight_dtype, "head_dim", name=name
            )
            q_BxTxHxE, k_BxTxKxE = norm("q_norm")(q_BxTxHxE), norm("k_norm")(k_BxTxKxE)
        q_BxTxHxE = apply_rope(q_BxTxHxE, rope)
        k_BxKxTxE = apply_rope(k_BxTxKxE, rope).transpose(0, 2, 1, 3)
        v_BxKxTxE = val.reshape(b, t, k, e).transpose(0, 2, 1, 3)
        q_BxTxKxRxE = q_BxTxHxE.reshape(b, t, k, h // k, e)
        dtype = c.compute_dtype
        if isinstance(attn_BxTxS, SegmentIds):  # packed rows: blocks across segments skipped
            kT_BxKxExT, seg_BxT = k_BxKxTxE.swapaxes(2, 3), attn_BxTxS.segment_BxT
            if _splash_applies(t, k):
                out = splash_attention(q_BxTxKxRxE, kT_BxKxExT, v_BxKxTxE, seg_BxT).astype(dtype)
            elif SEGMENT_BLOCK < t:
                out = blocked_attention(q_BxTxKxRxE, kT_BxKxExT, v_BxKxTxE, seg_BxT, dtype, SEGMENT_BLOCK)
            else:
                out = grouped_attention(
                    q_BxTxKxRxE, kT_BxKxExT, v_BxKxTxE, segment_attention_mask(seg_BxT), dtype
                )
        elif cache is None:
            kT_BxKxExT = k_BxKxTxE.swapaxes(2, 3)
            # memory first with remat (one block at a time), else fewer FLOPs (causal prefixes)
            chunk = attention_block(t, t)
            out = chunked_attention(
                q_BxTxKxRxE, kT_BxKxExT, v_BxKxTxE, attn_BxTxS, dtype, chunk, causal_prefix=c.remat is None
            )
        elif isinstance(cache_index_B, PageRefs):  # paged decode step: one token, a pool of pages
            out, cache = paged_attention.decode_step(
                q_BxTxKxRxE[:, 0], k_BxKxTxE[:, :, 0], v_BxKxTxE[:, :, 0], cache, cache_index_B, c.num_layers
            )
            out = out.astype(dtype)[:, None]
        else:
            cache = write_cache(cache, k_BxKxTxE, v_BxKxTxE, cache_index_B, c.transposed_keys)
            if t == 1:
                out = decode_attention(q_BxTxKxRxE[:, 0], cache, attn_BxTxS[:, 0], dtype, c.transposed_keys)
                out = out[:, None]
            else:
                kT_BxKxExS = cache.k if c.transposed_keys else cache.k.swapaxes(2, 3)
                chunk = attention_block(t, cache_slots(cache))
                out = chunked_attention(
                    q_BxTxKxRxE, kT_BxKxExS, cache.v, attn_BxTxS, dtype, chunk, causal_prefix=False
                )
        out = out.reshape(b, t, h * e)
        out = nn.with_logical_constraint(out, ("batch", "length", "heads"))
        return _dense(c, c.hidden_size, ("heads", "embed"), False, "o_proj")(out), cache


def _splash_applies(t: int, kv_heads: int) -> bool:
    """Whether packed rows' attention runs jax's splash kernel (`segment_attention.splash_attention`):
    on a mesh of TPU devices (abstract ones included, for AOT), outside manual axes, T a multiple
    of its blocks and the KV heads split evenly over the tensor axis."""
    mesh = jax.sharding.get_abstract_mesh()
    device = getattr(mesh, "abstract_device", None)
    if mesh.empty or device is None or mesh.manual_axes or device.platform != "tpu":
        return False
    return t % 512 == 0 and kv_heads % dict(mesh.shape).get("tensor", 1) == 0


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    config: ModelConfig

    @nn.compact
    def __call__(self, x_BxTxD):
        c = self.config
        gate = _dense(c, c.intermediate_size, ("embed", "mlp"), c.mlp_bias, "gate_proj")(x_BxTxD)
        up = _dense(c, c.intermediate_size, ("embed", "mlp"), c.mlp_bias, "up_proj")(x_BxTxD)
        h_BxTxF = nn.with_logical_constraint(nn.silu(gate) * up, ("batch", "length", "mlp"))
        return _dense(c, c.hidden_size, ("mlp", "embed"), c.mlp_bias, "down_proj")(h_BxTxF)


class DecoderLayer(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then + mlp(norm(x))."""

    config: ModelConfig

    @nn.compact
    def __call__(self, x_BxTxD, rope, attn_BxTxS, cache, cache_index_B):
        c = self.config
        norm = lambda name: RMSNorm(c.rms_norm_eps, c.compute_dtype, c.weight_dtype, name=name)
        h, cache = Attention(c, name="self_attn")(
            norm("input_layernorm")(x_BxTxD), rope, attn_BxTxS, cache, cache_index_B
        )
        x_BxTxD = x_BxTxD + h
        x_BxTxD = x_BxTxD + MLP(c, name="mlp")(norm("post_attention_layernorm")(x_BxTxD))
        return nn.with_logical_constraint(x_BxTxD, ("batch", "length", "embed")), cache


def _layer_class(c: ModelConfig):
    if c.remat is None:
        return DecoderLayer
    if c.remat not in REMAT_POLICIES:
        raise ValueError(f"remat {c.remat!r} is not one of the jax.checkpoint_policies {REMAT_POLICIES}")
    policy = getattr(jax.checkpoint_policies, c.remat)
    return nn.remat(DecoderLayer, policy=policy, prevent_cse=not c.scan_layers)


def _decoder_stack(c: ModelConfig, x_BxTxD, rope, attn_BxTxS, caches, cache_index_B):
    """The L decoder layers: a Python loop (params `layers_i`, caches a list) or, with
    `scan_layers`, one `nn.scan` body (params `layers` stacked on a leading axis named "layers",
    caches one stacked KVCache scanned along with them). A paged decode step: `_paged_stack`."""
    layer_cls = _layer_class(c)
    if isinstance(cache_index_B, PageRefs):
        return _paged_stack(c, layer_cls, x_BxTxD, rope, caches, cache_index_B)
    if not c.scan_layers:
        new_caches = []
        for i in range(c.num_layers):
            x_BxTxD, cache = layer_cls(c, name=f"layers_{i}")(
                x_BxTxD, rope, attn_BxTxS, None if caches is None else caches[i], cache_index_B
            )
            new_caches.append(cache)
        return x_BxTxD, (None if caches is None else new_caches)
    stack = _scan_layers(c, layer_cls, in_axes=(nn.broadcast, nn.broadcast, 0, nn.broadcast))
    return stack(c, name="layers")(x_BxTxD, rope, attn_BxTxS, caches, cache_index_B)


def _scan_layers(c: ModelConfig, target, **scan_args):
    """`nn.scan` of `target` over the L layers, its params stacked on a leading axis named
    "layers" (the layout `stack_layers` makes and `sharding.RULES` names)."""
    return nn.scan(
        target,
        variable_axes={"params": 0},
        split_rngs={"params": True},
        length=c.num_layers,
        metadata_params={nn.PARTITION_NAME: "layers"},
        **scan_args,
    )


def _paged_stack(c: ModelConfig, layer_cls, x_BxTxD, rope, pool_AxZxUxE, refs: PageRefs):
    """The L layers of a paged decode step, the pool of every layer's pages carried from layer
    to layer (layer l told by `refs.layer`), so that each layer's write updates it in place: a
    stacked pool scanned as xs and ys is copied whole every step. Params as `_decoder_stack`'s."""
    if not c.scan_layers:
        for i in range(c.num_layers):
            layer = layer_cls(c, name=f"layers_{i}")
            x_BxTxD, pool_AxZxUxE = layer(x_BxTxD, rope, None, pool_AxZxUxE, refs._replace(layer=i))
        return x_BxTxD, pool_AxZxUxE

    def body(layer, carry, i):
        x_BxTxD, pool_AxZxUxE = carry
        return layer(x_BxTxD, rope, None, pool_AxZxUxE, refs._replace(layer=i)), None

    (x_BxTxD, pool_AxZxUxE), _ = _scan_layers(c, body)(
        layer_cls(c, name="layers"), (x_BxTxD, pool_AxZxUxE), jnp.arange(c.num_layers)
    )
    return x_BxTxD, pool_AxZxUxE


def lm_head(config: ModelConfig, params, x_BxTxD) -> jax.Array:
    """`logits_BxTxV` in float32 from final hidden states, as the model's head computes them
    (inputs and weights in the compute dtype): for blocks of tokens at a time."""
    dtype = config.compute_dtype
    if config.tie_word_embeddings:
        w_VxD = params["embed_tokens"]["embedding"].astype(dtype)
        logits = jnp.dot(x_BxTxD.astype(dtype), w_VxD.T)
    else:
        logits = jnp.dot(x_BxTxD.astype(dtype), params["lm_head"]["kernel"].astype(dtype))
    return logits.astype(jnp.float32)


class Transformer(nn.Module):
    """Causal LM. `__call__(tokens_BxT, positions_BxT, attn_BxTxS, caches=None, cache_index_B=None)`
    returns `(logits_BxTxV in float32, new caches or None)`; with caches, row b writes its T
    tokens at slots `cache_index_B[b]` on. With `hidden_only` the final normalised hidden states
    `x_BxTxD` instead of the logits (`lm_head` maps them). Positions lie below T without a
    cache, below the cache's S slots with one (a token's position never exceeds its slot)."""

    config: ModelConfig

    @nn.compact
    def __call__(
        self,
        tokens_BxT,
        positions_BxT,
        attn_BxTxS,
        caches=None,
        cache_index_B=None,
        hidden_only: bool = False,
    ):
        c = self.config
        embed = nn.Embed(
            c.vocab_size,
            c.hidden_size,
            dtype=c.compute_dtype,
            param_dtype=c.weight_dtype,
            embedding_init=nn.with_logical_partitioning(nn.initializers.normal(0.02), ("vocab", "embed")),
            name="embed_tokens",
        )
        x_BxTxD = nn.with_logical_constraint(embed(tokens_BxT), ("batch", "length", "embed"))
        if isinstance(cache_index_B, PageRefs):  # bound on the positions: a row's I pages of Z slots
            bound = cache_index_B.table_BxI.shape[1] * caches.shape[1]
        else:
            bound = tokens_BxT.shape[1] if caches is None else cache_slots(caches)
        rope = rope_tables(positions_BxT, c, bound)
        x_BxTxD, new_caches = _decoder_stack(c, x_BxTxD, rope, attn_BxTxS, caches, cache_index_B)
        x_BxTxD = RMSNorm(c.rms_norm_eps, c.compute_dtype, c.weight_dtype, name="norm")(x_BxTxD)
        if hidden_only:  # (init runs the head, so its parameters exist)
            return x_BxTxD, new_caches
        if c.tie_word_embeddings:
            logits = embed.attend(x_BxTxD)
        else:
            logits = _dense(c, c.vocab_size, ("embed", "vocab"), False, "lm_head")(x_BxTxD)
        logits = nn.with_logical_constraint(logits.astype(jnp.float32), ("batch", "length", "vocab"))
        return logits, new_caches


def forward(model: Transformer, params, tokens_BxT, mask_BxT) -> jax.Array:
    """Teacher-forced logits `logits_BxTxV` of a (left- or right-) padded batch, or of packed
    rows when `mask_BxT` holds segment ids (`teacher_forced_inputs`), no cache."""
    logits, _ = model.apply({"params": params}, tokens_BxT, *teacher_forced_inputs(mask_BxT))
    return logits


def forward_hidden(model: Transformer, params, tokens_BxT, mask_BxT) -> jax.Array:
    """Teacher-forced final hidden states `x_BxTxD` (what `lm_head` maps to the logits)."""
    x_BxTxD, _ = model.apply(
        {"params": params}, tokens_BxT, *teacher_forced_inputs(mask_BxT), hidden_only=True
    )
    return x_BxTxD


def stack_layers(params, num_layers: int):
    """Unrolled params (`layers_0` ... `layers_{L-1}`) in the scanned layout: one `layers` tree
    whose leaves are the L layers' leaves stacked on a new leading axis."""
    per_layer = [params[f"layers_{i}"] for i in range(num_layers)]
    rest = {k: v for k, v in params.items() if not k.startswith("layers_")}
    return {**rest, "layers": jax.tree.map(lambda *xs: jnp.stack(xs), *per_layer)}


def unstack_layers(params):
    """Scanned params in the unrolled layout: `layers` split along its leading axis."""
    stacked = params["layers"]
    num_layers = jax.tree.leaves(stacked)[0].shape[0]
    rest = {k: v for k, v in params.items() if k != "layers"}
    return {**rest, **{f"layers_{i}": jax.tree.map(lambda x, i=i: x[i], stacked) for i in range(num_layers)}}

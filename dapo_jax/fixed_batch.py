"""The fixed batch: the prefill caches repeated G times and all B = P*G rows decoded together, at
the same t, until every row has ended.

It runs in `decode_chunks` phases, each a `while_loop` whose caches hold only the slots filled by
the phase's end (`decode_phases`, grown with empty slots between phases): early steps read less
cache. Rows that have ended still cost a row of every step until the longest ends. On XLA:CPU it
is the faster loop at uniform lengths, where the engine's page gathers cost more than the rows it
saves (experiments/README.md); the engine (`engine.py`) is the TPU configs' loop.
"""

from __future__ import annotations

from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from dapo_jax.decoding import Samples, SamplingConfig, decode_step, outputs, prefill, sample_token
from dapo_jax.model import KVCache, ModelConfig, cache_layer_axes, cache_slot_axes, cache_slots


def cache_logical_axes(config: ModelConfig) -> KVCache:
    """The logical axes of a layer's key and value arrays (`model.KVCache`'s two layouts of keys)."""
    v = ("batch", "kv_heads", "length", None)
    return KVCache(k=("batch", "kv_heads", None, "length") if config.transposed_keys else v, v=v)


def decode_phases(config: SamplingConfig, prompt_len: int) -> list[tuple[int, int]]:
    """`(end, slots)` of each fixed-batch decode phase: `decode_chunks` near-equal parts of the N
    steps, the last step at `end` - 1, over caches of the slots filled by then."""
    n_new = config.max_new_tokens
    chunks = min(config.decode_chunks, n_new)
    ends = [-(-n_new * (j + 1) // chunks) for j in range(chunks)]
    return [(end, prompt_len - 1 + end) for end in ends]


def _cache_list(caches) -> list[KVCache]:
    """The per-layer caches, or the one stacked KVCache of a scanned model, as a list."""
    return [caches] if isinstance(caches, KVCache) else list(caches)


def _from_list(caches: list[KVCache], like):
    return caches[0] if isinstance(like, KVCache) else caches


def _grow(caches, slots: int, config: ModelConfig):
    """Caches extended with empty slots up to `slots`."""
    lead = cache_layer_axes(caches)

    def pad(x, axis):
        return jnp.pad(x, [(0, slots - x.shape[axis]) if a == axis else (0, 0) for a in range(x.ndim)])

    axes = KVCache(*(lead + a for a in cache_slot_axes(config)))
    return _from_list([KVCache(*map(pad, c, axes)) for c in _cache_list(caches)], caches)


def _constrain_caches(caches, config: ModelConfig):
    """Caches laid out as `cache_logical_axes` (behind the layer axis of a stacked cache)."""
    lead = ("layers",) * cache_layer_axes(caches)
    out = [
        KVCache(*(nn.with_logical_constraint(x, lead + a) for x, a in zip(c, cache_logical_axes(config))))
        for c in _cache_list(caches)
    ]
    return _from_list(out, caches)


def _repeat_caches(caches, group_size: int):
    """Every cache row repeated G = `group_size` times along the batch (row b = p*G + g)."""
    axis = cache_layer_axes(caches)
    return jax.tree.map(lambda x: jnp.repeat(x, group_size, axis=axis), caches)


class _BatchState(NamedTuple):
    step: jax.Array  # t: tokens sampled so far by every row
    feed_B: jax.Array  # token fed at slot Q-1+t
    caches: list[KVCache] | KVCache  # per layer, or stacked (scanned model)
    tokens_BxN: jax.Array
    logp_BxN: jax.Array
    ended_B: jax.Array  # sampled an end id
    length_B: jax.Array


def rollout(model, config: SamplingConfig, group_size: int, params, prompt_PxQ, mask_PxQ, u_BxN) -> Samples:
    """All P*G rows decoded together, in `decode_phases`, until every row has ended."""
    p, q = prompt_PxQ.shape
    n_new, b = config.max_new_tokens, p * group_size
    repeat = lambda x: jnp.repeat(x, group_size, axis=0)
    phases = decode_phases(config, q)
    caches = prefill(model, params, prompt_PxQ[:, :-1], mask_PxQ[:, :-1], phases[0][1])
    caches = _constrain_caches(_repeat_caches(caches, group_size), model.config)
    readable_BxS = repeat(jnp.pad(mask_PxQ, ((0, 0), (0, phases[-1][1] - q)), constant_values=True))
    first_pos_B = repeat(mask_PxQ.sum(-1, dtype=jnp.int32) - 1)
    end_ids = jnp.asarray(config.eos_ids, jnp.int32).reshape(-1)

    def body(st: _BatchState) -> _BatchState:
        slot = q - 1 + st.step
        w = cache_slots(st.caches)  # this phase's slots
        attn_BxW = readable_BxS[:, :w] & (jnp.arange(w) <= slot)
        logits_BxV, caches = decode_step(
            model, params, st.feed_B, first_pos_B + st.step, attn_BxW, st.caches, slot
        )
        u_B = jax.lax.dynamic_index_in_dim(u_BxN, st.step, 1, keepdims=False)
        token_B, logp_B = sample_token(logits_BxV, u_B, config)
        token_B = jnp.where(st.ended_B, config.pad_id, token_B)
        logp_B = jnp.where(st.ended_B, 0.0, logp_B)
        return _BatchState(
            step=st.step + 1,
            feed_B=token_B,
            caches=_constrain_caches(caches, model.config),
            tokens_BxN=jax.lax.dynamic_update_index_in_dim(st.tokens_BxN, token_B, st.step, 1),
            logp_BxN=jax.lax.dynamic_update_index_in_dim(st.logp_BxN, logp_B, st.step, 1),
            ended_B=st.ended_B | jnp.isin(token_B, end_ids),
            length_B=st.length_B + (~st.ended_B),
        )

    out = _BatchState(
        step=jnp.zeros((), jnp.int32),
        feed_B=repeat(prompt_PxQ[:, -1]),
        caches=caches,
        tokens_BxN=jnp.full((b, n_new), config.pad_id, jnp.int32),
        logp_BxN=jnp.zeros((b, n_new), jnp.float32),
        ended_B=jnp.zeros((b,), bool),
        length_B=jnp.zeros((b,), jnp.int32),
    )
    for j, (end, slots) in enumerate(phases):
        if j:
            grown = _grow(out.caches, slots, model.config)
            out = out._replace(caches=_constrain_caches(grown, model.config))
        out = jax.lax.while_loop(lambda st, end=end: (st.step < end) & ~jnp.all(st.ended_B), body, out)
    return outputs(out.tokens_BxN, out.logp_BxN, out.ended_B, out.length_B)

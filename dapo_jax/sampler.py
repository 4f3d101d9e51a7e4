"""Rollouts: prefill P left-padded prompts once, then sample G completions of each in one jitted loop.

Layout. Prompts are left padded to a bucket length L, so every prompt ends at cache slot L-1. The
prefill runs the first L-1 prompt columns into per-layer KV caches (N = max new tokens; at most
L + N - 1 slots are used). Row b = p*G + g (a group's rows contiguous) samples its token t by
feeding one token at slot L-1+t of its cache, the last prompt token when t = 0 and its token t-1
after, at position `prompt_len - 1 + t`. A row reads cache slot s iff s holds a real prompt token
or a token it fed, and s <= L-1+t. A row ends at an id of `eos_ids` (kept and counted in its
length) or after N tokens (truncated).

Two loops, chosen by `paged`:
- The engine (`paged`, `engine.py`): continuous batching in S = `decode_slots` slots (0: all
  rows) over a paged KV cache, a pool of `kv_pages` pages of `page_size` slots, each row
  attending over only the pages it holds; a prompt's full pages shared by its G rows. A row
  ends, its slot and pages free at once, the next waiting row starts: the loop's steps follow
  the sum of the rows' lengths over S, not the longest. The TPU configs' path.
- Fixed batch: the prefill caches are repeated G times and all B = P*G rows decode together,
  at the same t, until every row has ended. It runs in `decode_chunks` phases, each a
  `while_loop` whose caches hold only the slots filled by the phase's end (`decode_phases`, grown
  with empty slots between phases): early steps read less cache. Rows that have ended still cost
  a row of every step until the longest ends. XLA:CPU's faster loop at uniform lengths, where
  the engine's page gathers cost more than the rows it saves (experiments/README.md).

Devices. P is filled up to a multiple of the d data x fsdp shards with copies of the last prompt,
whose rows are dropped. With the engine, or on a mesh that splits only the batch, each shard
runs the loop by itself (`sharding.loop_per_data_shard`) on its P / d prompts, all their rows,
tensor parallel inside: no shard waits for another's longest row. The fixed batch on a mesh
that also splits the weights runs one loop over the mesh, its stopping test agreed at every
step: XLA's partitioning of its cache puts collective permutes in the loop, which on XLA:CPU
wait for every device of the mesh, so loops that stop at different steps deadlock (seen with
bf16 weights on data 4 x tensor 2).

The rows' tokens and log-probs do not depend on the loop, the slot count, the batch, the devices
or the slots a row is given (to float rounding of the attention sums, ~1e-7).

Log-probs. `logp_BxN` is log_softmax(logits / temperature) at the sampled token, before top-k /
top-p truncation: the distribution the trainer recomputes from the same parameters with
`model.forward`, so that the importance ratio of the first update is exactly one. The truncation only
changes which tokens can be drawn.

Randomness. Row (p, g) draws its N uniform numbers u at once, before the loop, with key
fold_in(fold_in(rng, uid_p), g); step t samples with the t-th. Samples are reproducible and a row's
samples do not depend on the other rows of the batch.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from dapo_jax import sharding, sizes
from dapo_jax.model import (
    KVCache,
    ModelConfig,
    Transformer,
    cache_layer_axes,
    cache_slot_axes,
    cache_slots,
    causal_attention_mask,
    init_cache,
    positions_from_mask,
)


def cache_logical_axes(config: ModelConfig) -> KVCache:
    """The logical axes of a layer's key and value arrays (`model.KVCache`'s two layouts of keys)."""
    v = ("batch", "kv_heads", "length", None)
    return KVCache(k=("batch", "kv_heads", None, "length") if config.transposed_keys else v, v=v)


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """Static sampling knobs: changing any of them compiles a new rollout function."""

    max_new_tokens: int  # N, completion length budget
    eos_ids: tuple[int, ...]  # ids that end a sequence: EOS and any stop tokens
    pad_id: int  # fills the completion after its end
    prompt_buckets: tuple[int, ...]  # prompt lengths L compiled for, ascending
    temperature: float = 1.0
    top_p: float = 1.0  # nucleus: keep the most likely tokens up to this probability mass
    top_k: int = 0  # keep the k most likely tokens; 0 keeps all
    greedy: bool = False  # argmax instead of sampling (logp still under log_softmax(logits / T))
    decode_chunks: int = 4  # the fixed batch's phases; each attends over the slots filled by its end
    paged: bool = False  # the engine (`engine`): continuous batching over a paged KV cache
    decode_slots: int = 0  # S: the engine's rows decoded at once (0: all rows)
    page_size: int = 16  # Z: KV slots per page of the engine's pool
    kv_pages: int = 0  # M: pages of the engine's pool per loop (0: every slot at N tokens)

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if (
            not self.prompt_buckets
            or list(self.prompt_buckets) != sorted(set(self.prompt_buckets))
            or self.prompt_buckets[0] < 1
        ):
            raise ValueError(f"prompt_buckets must be positive and ascending, got {self.prompt_buckets}")
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0 (use greedy=True), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.decode_chunks < 1:
            raise ValueError(f"decode_chunks must be >= 1, got {self.decode_chunks}")
        if self.decode_slots < 0:
            raise ValueError(f"decode_slots must be >= 0 (0: every row), got {self.decode_slots}")
        if self.decode_slots and not self.paged:
            raise ValueError(
                f"decode_slots {self.decode_slots} sets the engine's slots: set paged=True "
                "(continuous batching runs on the engine), or decode_slots=0 for a fixed batch"
            )
        if self.page_size < 1 or self.kv_pages < 0:
            raise ValueError(
                f"page_size must be >= 1 and kv_pages >= 0, got {self.page_size}, {self.kv_pages}"
            )


def prefill(model: Transformer, params, tokens_PxT, mask_PxT, cache_len: int):
    """Fresh caches of `cache_len` slots holding the keys/values of the T prompt tokens at slots
    0..T-1 (a list of per-layer caches, or one stacked KVCache for a scanned model). The logits
    are not used, so XLA drops the LM head over the T x vocab positions."""
    p, t = tokens_PxT.shape
    caches = init_cache(model.config, p, cache_len)
    if t == 0:
        return caches
    attn_PxTxS = jnp.pad(causal_attention_mask(mask_PxT), ((0, 0), (0, 0), (0, cache_len - t)))
    positions_PxT = positions_from_mask(mask_PxT)
    _, caches = model.apply({"params": params}, tokens_PxT, positions_PxT, attn_PxTxS, caches, jnp.int32(0))
    return caches


def decode_step(model: Transformer, params, tokens_B, positions_B, attn_BxS, caches, slot_B):
    """Feed row b's token at position `positions_B[b]` into cache slot `slot_B[b]` (a scalar: every
    row's), reading the slots `attn_BxS[b]` allows; returns `(logits_BxV, caches)`."""
    logits_Bx1xV, caches = model.apply(
        {"params": params}, tokens_B[:, None], positions_B[:, None], attn_BxS[:, None, :], caches, slot_B
    )
    return logits_Bx1xV[:, 0], caches


def truncate_logits(logits_BxV, top_k: int, top_p: float):
    """Set to -inf the logits outside the top k, then outside the smallest set of most likely
    tokens whose (renormalised) probability reaches top_p. Ties at the boundary are kept."""
    if top_k:
        kth_Bx1 = jax.lax.top_k(logits_BxV, top_k)[0][:, -1:]
        logits_BxV = jnp.where(logits_BxV < kth_Bx1, -jnp.inf, logits_BxV)
    if top_p < 1:
        sorted_BxV = -jnp.sort(-logits_BxV, axis=-1)
        probs_BxV = jax.nn.softmax(sorted_BxV, axis=-1)
        mass_before_BxV = jnp.cumsum(probs_BxV, axis=-1) - probs_BxV
        cutoff_Bx1 = jnp.min(jnp.where(mass_before_BxV < top_p, sorted_BxV, jnp.inf), -1, keepdims=True)
        logits_BxV = jnp.where(logits_BxV < cutoff_Bx1, -jnp.inf, logits_BxV)
    return logits_BxV


def _first_reaching(p_BxN, target_B):
    """`(i_B, rest_B)`: the first i with p_i > 0 whose cumulative sum reaches target (the last
    positive i when rounding leaves none), and target minus the mass before i."""
    cdf_BxN = jnp.cumsum(p_BxN, axis=-1)
    positive_BxN = p_BxN > 0
    hit_BxN = (cdf_BxN >= target_B[:, None]) & positive_BxN
    last_B = p_BxN.shape[-1] - 1 - jnp.argmax(positive_BxN[:, ::-1], axis=-1)
    i_B = jnp.where(hit_BxN.any(-1), jnp.argmax(hit_BxN, axis=-1), last_B)
    before_B = jnp.take_along_axis(cdf_BxN - p_BxN, i_B[:, None], axis=-1)[:, 0]
    return i_B, target_B - before_B


def draw_inverse_cdf(probs_BxV, u_B):
    """Token i with cdf(i-1) < u * cdf(V-1) <= cdf(i), u in (0, 1], for probabilities known up to
    a factor (`probs_BxV` need not sum to one); tokens of probability 0 are never drawn. Two levels
    of C ~ sqrt(V) entries, first the block of C tokens, then the token within it, so that no
    cumulative sum runs over the whole vocabulary (a full-length cumsum was a twentieth of a CPU
    decode step)."""
    b, v = probs_BxV.shape
    c = 1 << max(0, (v - 1).bit_length() + 1) // 2
    blocks = -(-v // c)
    probs_BxNxC = jnp.pad(probs_BxV, ((0, 0), (0, blocks * c - v))).reshape(b, blocks, c)
    mass_BxN = probs_BxNxC.sum(-1)
    block_B, rest_B = _first_reaching(mass_BxN, u_B * mass_BxN.sum(-1))
    within_BxC = jnp.take_along_axis(probs_BxNxC, block_B[:, None, None], axis=1)[:, 0]
    index_B, _ = _first_reaching(within_BxC, rest_B)
    return block_B * c + index_B


def sample_token(logits_BxV, u_B, config: SamplingConfig):
    """Draw one token per row by inverse CDF at `u_B` in (0, 1]; returns `(token_B, logp_B)` with
    logp under log_softmax(logits / T). One uniform number per row: the Gumbel trick's one per
    vocabulary entry dominated a CPU decode step. One exp pass serves both: the kept tokens'
    weights exp(x - max) are the truncated distribution up to its normaliser."""
    scaled_BxV = logits_BxV / config.temperature
    max_Bx1 = jnp.max(scaled_BxV, axis=-1, keepdims=True)
    weights_BxV = jnp.exp(scaled_BxV - max_Bx1)
    if config.greedy:
        token_B = jnp.argmax(logits_BxV, axis=-1)
    elif config.top_k or config.top_p < 1:
        kept_BxV = truncate_logits(scaled_BxV, config.top_k, config.top_p) > -jnp.inf
        token_B = draw_inverse_cdf(jnp.where(kept_BxV, weights_BxV, 0.0), u_B)
    else:
        token_B = draw_inverse_cdf(weights_BxV, u_B)
    log_z_B = jnp.log(jnp.sum(weights_BxV, axis=-1))
    drawn_B = jnp.take_along_axis(scaled_BxV - max_Bx1, token_B[:, None], axis=-1)[:, 0]
    return token_B.astype(jnp.int32), drawn_B - log_z_B


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


def _repeat_caches(caches, n: int):
    """Every cache row repeated n times along the batch (row b = p*n + g)."""
    axis = cache_layer_axes(caches)
    return jax.tree.map(lambda x: jnp.repeat(x, n, axis=axis), caches)


def _row_uniforms(rng, uids_P, n: int, n_new: int):
    """`u_BxN` in (0, 1]: row b = p*n + g draws its N numbers at once, with key
    fold_in(fold_in(rng, uid_p), g); its token t is sampled with the t-th."""
    p = uids_P.shape[0]
    prompt_keys_P = jax.vmap(jax.random.fold_in, (None, 0))(rng, uids_P)
    row_keys_B = jax.vmap(jax.random.fold_in)(
        jnp.repeat(prompt_keys_P, n, axis=0), jnp.tile(jnp.arange(n), p)
    )
    return 1.0 - jax.vmap(lambda key: jax.random.uniform(key, (n_new,)))(row_keys_B)


class Samples(NamedTuple):
    """The sampler's B = P x G rows (row p x G + g), sharded over the data axes."""

    tokens_BxN: jax.Array  # int32, pad_id after the end
    logp_BxN: jax.Array  # f32 log pi_sampler of each token, 0 after the end
    mask_BxN: jax.Array  # bool, the response's tokens
    length_B: jax.Array  # tokens generated, the end id included
    truncated_B: jax.Array  # bool, reached N tokens without an end id


def _outputs(tokens_BxN, logp_BxN, ended_B, length_B) -> Samples:
    mask_BxN = jnp.arange(tokens_BxN.shape[1]) < length_B[:, None]
    return Samples(tokens_BxN, logp_BxN, mask_BxN, length_B, ~ended_B)


class _BatchState(NamedTuple):
    step: jax.Array  # t: tokens sampled so far by every row
    feed_B: jax.Array  # token fed at slot L-1+t
    caches: list[KVCache] | KVCache  # per layer, or stacked (scanned model)
    tokens_BxN: jax.Array
    logp_BxN: jax.Array
    ended_B: jax.Array  # sampled an end id
    length_B: jax.Array


def _fixed_batch_rollout(
    model, config: SamplingConfig, n: int, params, prompt_PxL, mask_PxL, u_BxN
) -> Samples:
    """All P*n rows decoded together, in `decode_phases`, until every row has ended."""
    p, l = prompt_PxL.shape
    n_new, b = config.max_new_tokens, p * n
    repeat = lambda x: jnp.repeat(x, n, axis=0)
    phases = decode_phases(config, l)
    caches = prefill(model, params, prompt_PxL[:, :-1], mask_PxL[:, :-1], phases[0][1])
    caches = _constrain_caches(_repeat_caches(caches, n), model.config)
    readable_BxS = repeat(jnp.pad(mask_PxL, ((0, 0), (0, phases[-1][1] - l)), constant_values=True))
    first_pos_B = repeat(mask_PxL.sum(-1, dtype=jnp.int32) - 1)
    eos_E = jnp.asarray(config.eos_ids, jnp.int32).reshape(-1)

    def body(st: _BatchState) -> _BatchState:
        slot = l - 1 + st.step
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
            ended_B=st.ended_B | jnp.isin(token_B, eos_E),
            length_B=st.length_B + (~st.ended_B),
        )

    out = _BatchState(
        step=jnp.zeros((), jnp.int32),
        feed_B=repeat(prompt_PxL[:, -1]),
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
    return _outputs(out.tokens_BxN, out.logp_BxN, out.ended_B, out.length_B)


def rollout(
    model: Transformer, config: SamplingConfig, n: int, params, prompt_PxL, mask_PxL, uids_P, rng
) -> Samples:
    """G = `n` completions of each of P left-padded prompts (pure; jitted by `Sampler`): the
    engine (`config.paged`) or the fixed batch."""
    u_BxN = _row_uniforms(rng, uids_P, n, config.max_new_tokens)
    if config.paged:
        from dapo_jax import engine  # noqa: PLC0415 - the engine builds on this module

        return engine.paged_rollout(model, config, n, params, prompt_PxL, mask_PxL.astype(bool), u_BxN)[0]
    return _fixed_batch_rollout(model, config, n, params, prompt_PxL, mask_PxL.astype(bool), u_BxN)


def _fit_bucket(prompt_PxL: np.ndarray, mask_PxL: np.ndarray, buckets: tuple[int, ...], pad_id: int):
    """Re-pad a left-padded batch to the smallest bucket that holds its longest prompt."""
    mask_PxL = np.asarray(mask_PxL, bool)
    lengths_P = mask_PxL.sum(-1)
    if np.any(np.diff(mask_PxL.astype(np.int8), axis=-1) < 0):
        raise ValueError("prompts must be left padded: a pad follows a real token")
    if lengths_P.min(initial=1) < 1:
        raise ValueError("every prompt needs at least one real token")
    longest = int(lengths_P.max())
    fits = [b for b in buckets if b >= longest]
    if not fits:
        raise ValueError(f"a prompt of {longest} tokens exceeds the largest bucket {buckets[-1]}")
    width, l = fits[0], prompt_PxL.shape[1]
    if width <= l:
        return np.asarray(prompt_PxL[:, l - width :], np.int32), mask_PxL[:, l - width :]
    pad = ((0, 0), (width - l, 0))
    return (
        np.pad(np.asarray(prompt_PxL, np.int32), pad, constant_values=pad_id),
        np.pad(mask_PxL, pad, constant_values=False),
    )


def _fitted_call(fn, params, prompt_PxL, mask_PxL, uids_P, rng, n: int, devices: int) -> Samples:
    """`fn`'s P x n rows, `fn` called on the prompts filled up to a multiple of `devices`
    (`sizes.padded_count`, copies of the last prompt) and the fill's rows dropped."""
    p = prompt_PxL.shape[0]
    fit = sizes.padded_count(p, devices)
    out = fn(params, *(sizes.pad_rows(x, fit) for x in (prompt_PxL, mask_PxL, uids_P)), rng)
    return out if fit == p else jax.tree.map(lambda x: x[: p * n], out)


class Sampler:
    """Rollouts of `model` with the trainer's parameters, where they lie on `mesh`.

    One compilation per (prompt bucket, P, G); `num_traces` counts them. The KV cache beside the
    weights holds, with the engine, `config.kv_pages` pages a shard; with a fixed batch, the
    batch's rows, or with `micro_batch_prompts` that many prompts x G at a time.
    """

    def __init__(self, model: Transformer, config: SamplingConfig, mesh: Mesh, micro_batch_prompts: int = 0):
        self.model, self.config, self.mesh = model, config, mesh
        self.micro_batch_prompts = micro_batch_prompts  # prompts decoded at once (0: all)
        self.num_traces = 0
        self._param_shardings = sharding.param_shardings(model, mesh)
        self._data_size = mesh.shape["data"] * mesh.shape["fsdp"]
        sizes.check_decode_slots(config.decode_slots, self._data_size)
        self._jitted = {}  # n -> jitted rollout

    def _rollout_fn(self, n: int):
        if n in self._jitted:
            return self._jitted[n]
        d = self._data_size
        config = dataclasses.replace(self.config, decode_slots=self.config.decode_slots // d)  # a shard's

        def traced(*args):
            self.num_traces += 1
            return rollout(self.model, config, n, *args)

        per_shard = d > 1 and (config.paged or sharding.splits_only_the_batch(self.mesh))
        fn = sharding.loop_per_data_shard(traced, self.mesh) if per_shard else traced
        rep = sharding.replicated(self.mesh)
        out = Samples(
            *(sharding.batch_sharding(self.mesh, 2) for _ in range(3)),
            *(sharding.batch_sharding(self.mesh, 1) for _ in range(2)),
        )
        self._jitted[n] = jax.jit(
            fn, in_shardings=(self._param_shardings, rep, rep, rep, rep), out_shardings=out
        )
        return self._jitted[n]

    def generate(self, params, prompt_PxL, mask_PxL, n: int, rng, uids_P=None) -> Samples:
        """`n` completions of each left-padded prompt, B = P*n rows (`Samples`). `uids_P`
        (default 0..P-1) seed each prompt's rows with its own key.
        Any P and n: prompts that do not split over the data x fsdp shards are filled up to a
        count that does (`sizes.padded_count`) with copies of the last one, whose rows are
        dropped (the rows then come back replicated)."""
        p = prompt_PxL.shape[0]
        uids_P = np.arange(p, dtype=np.int32) if uids_P is None else np.asarray(uids_P, np.int32)
        prompt_PxL, mask_PxL = _fit_bucket(
            prompt_PxL, mask_PxL, self.config.prompt_buckets, self.config.pad_id
        )
        m = self.micro_batch_prompts or p
        fn = self.program(n)
        outs = []
        for i in range(0, p, m):  # each row's samples depend on its uid only, not on m
            part = [x[i : i + m] for x in (prompt_PxL, mask_PxL, uids_P)]
            outs.append(_fitted_call(fn, params, *part, rng, n, self._data_size))
        return outs[0] if len(outs) == 1 else jax.tree.map(lambda *xs: jnp.concatenate(xs), *outs)

    def program(self, n: int):
        """The compiled rollout of one micro-batch, `n` samples a prompt: `fn(params, prompt_PxL,
        mask_PxL, uids_P, rng) -> Samples` of P*n rows (prompts in a bucket, left padded, P a
        multiple of the data x fsdp shards), and `fn.lower(...)` of the same arguments as
        ShapeDtypeStructs (the AOT check). The one entry of the rollout's program, built once per n."""
        return sharding.on_mesh(self._rollout_fn(n), self.mesh)

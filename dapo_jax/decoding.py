"""What both rollout loops share: the sampling knobs, the model's prefill and one decode step, the
draw of a token, the rows' uniform numbers and the rows they return.

Layout. Prompts are left padded to a bucket length Q, so every prompt ends at cache slot Q-1. The
prefill runs the first Q-1 prompt columns into per-layer KV caches (N = max new tokens; at most
Q + N - 1 slots are used). Row b = p*G + g (a group's rows contiguous) samples its token t by
feeding one token at slot Q-1+t of its cache, the last prompt token when t = 0 and its token t-1
after, at position `prompt_len - 1 + t`. A row reads cache slot s iff s holds a real prompt token
or a token it fed, and s <= Q-1+t. A row ends at an id of `eos_ids` (kept and counted in its
length) or after N tokens (truncated).

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

import jax
import jax.numpy as jnp

from dapo_jax.model import Transformer, causal_attention_mask, init_cache, positions_from_mask


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """Static sampling knobs: changing any of them compiles a new rollout function."""

    max_new_tokens: int  # N, completion length budget
    eos_ids: tuple[int, ...]  # ids that end a sequence: EOS and any stop tokens
    pad_id: int  # fills the completion after its end
    prompt_buckets: tuple[int, ...]  # prompt lengths Q compiled for, ascending
    temperature: float = 1.0
    top_p: float = 1.0  # nucleus: keep the most likely tokens up to this probability mass
    top_k: int | None = None  # keep the k most likely tokens; None keeps all
    greedy: bool = False  # argmax instead of sampling (logp still under log_softmax(logits / T))
    decode_chunks: int = 4  # the fixed batch's phases; each attends over the slots filled by its end
    paged: bool = False  # the engine (`engine`): continuous batching over a paged KV cache
    decode_slots: int | None = None  # S: the engine's rows decoded at once (None: all rows)
    page_size: int = 16  # Z: KV slots per page of the engine's pool
    kv_pages: int | None = None  # M: pages of the engine's pool per loop (None: every slot at N tokens)

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
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be >= 1 (None: all tokens), got {self.top_k}")
        if self.decode_chunks < 1:
            raise ValueError(f"decode_chunks must be >= 1, got {self.decode_chunks}")
        if self.decode_slots is not None and self.decode_slots < 1:
            raise ValueError(f"decode_slots must be >= 1 (None: every row), got {self.decode_slots}")
        if self.decode_slots and not self.paged:
            raise ValueError(
                f"decode_slots {self.decode_slots} sets the engine's slots: set paged=True "
                "(continuous batching runs on the engine), or decode_slots=None for a fixed batch"
            )
        if self.page_size < 1 or (self.kv_pages is not None and self.kv_pages < 1):
            raise ValueError(
                f"page_size must be >= 1 and kv_pages >= 1 or None, got {self.page_size}, {self.kv_pages}"
            )

    def for_shard(self, shards: int) -> SamplingConfig:
        """The config one of `shards` data shards runs: its S / d of the engine's slots."""
        return dataclasses.replace(self, decode_slots=self.decode_slots and self.decode_slots // shards)


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


def truncate_logits(logits_BxV, top_k: int | None, top_p: float):
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


def _first_reaching(p_BxJ, target_B):
    """`(i_B, rest_B)`: the first i with p_i > 0 whose cumulative sum reaches target (the last
    positive i when rounding leaves none), and target minus the mass before i."""
    cdf_BxJ = jnp.cumsum(p_BxJ, axis=-1)
    positive_BxJ = p_BxJ > 0
    hit_BxJ = (cdf_BxJ >= target_B[:, None]) & positive_BxJ
    last_B = p_BxJ.shape[-1] - 1 - jnp.argmax(positive_BxJ[:, ::-1], axis=-1)
    i_B = jnp.where(hit_BxJ.any(-1), jnp.argmax(hit_BxJ, axis=-1), last_B)
    before_B = jnp.take_along_axis(cdf_BxJ - p_BxJ, i_B[:, None], axis=-1)[:, 0]
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
    probs_BxJxC = jnp.pad(probs_BxV, ((0, 0), (0, blocks * c - v))).reshape(b, blocks, c)
    mass_BxJ = probs_BxJxC.sum(-1)
    block_B, rest_B = _first_reaching(mass_BxJ, u_B * mass_BxJ.sum(-1))
    within_BxC = jnp.take_along_axis(probs_BxJxC, block_B[:, None, None], axis=1)[:, 0]
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


def row_uniforms(rng, uids_P, group_size: int, n_new: int):
    """`u_BxN` in (0, 1]: row b = p*G + g draws its N = `n_new` numbers at once, with key
    fold_in(fold_in(rng, uid_p), g); its token t is sampled with the t-th."""
    p = uids_P.shape[0]
    prompt_keys_P = jax.vmap(jax.random.fold_in, (None, 0))(rng, uids_P)
    row_keys_B = jax.vmap(jax.random.fold_in)(
        jnp.repeat(prompt_keys_P, group_size, axis=0), jnp.tile(jnp.arange(group_size), p)
    )
    return 1.0 - jax.vmap(lambda key: jax.random.uniform(key, (n_new,)))(row_keys_B)


class Samples(NamedTuple):
    """The sampler's B = P x G rows (row p x G + g), sharded over the data axes."""

    tokens_BxN: jax.Array  # int32, pad_id after the end
    logp_BxN: jax.Array  # f32 log pi_sampler of each token, 0 after the end
    mask_BxN: jax.Array  # bool, the response's tokens
    length_B: jax.Array  # tokens generated, the end id included
    truncated_B: jax.Array  # bool, reached N tokens without an end id


def outputs(tokens_BxN, logp_BxN, ended_B, length_B) -> Samples:
    mask_BxN = jnp.arange(tokens_BxN.shape[1]) < length_B[:, None]
    return Samples(tokens_BxN, logp_BxN, mask_BxN, length_B, ~ended_B)

"""DAPO's objective as pure maths: group-relative advantages, the clipped policy loss, aggregation.

Symbols (docs/dapo_spec.md sections 1-3): G responses per prompt, A_i the advantage of response o_i,
r_{i,t} = pi_theta(o_{i,t}) / pi_old(o_{i,t}) the per-token importance ratio, m_{i,t} the mask of
the tokens that carry loss, ε_low / ε_high the clip range (Clip-Higher), c the dual-clip constant,
β the KL coefficient. Per-token arrays are `_BxT`, per-response arrays `_B`.

Every loss and metric is a sum over tokens divided by a denominator of the WHOLE optimizer
mini-batch (`Denominators`). `policy_loss_sum` takes those denominators from its caller, so the
values it returns for the micro-batches of a mini-batch (and for its data-parallel shards) add up to
`policy_loss` of the mini-batch: gradient accumulation gives the gradient of one big batch. (verl's
older actor normalised each micro-batch by its own token count, verl #5625; we do not.)
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
_LOG_RATIO_LIMIT = 20.0  # |log r| is clamped here (as verl) so that exp(log r) cannot overflow
_K3_LIMIT = 10.0  # the k3 term is clamped to [-10, 10] (the recipe's low_var_kl)


def group_advantages(rewards_B, group_size: int, normalize_std: bool = True) -> jax.Array:
    """A_i = (R_i - mean(R_group)) / (std(R_group) + 1e-6), the std unbiased (N - 1).

    Rows of a group are contiguous: `rewards_B` is P groups of `group_size`. A group of one has
    mean 0 and std 1. `normalize_std=False` gives Dr.GRPO's A_i = R_i - mean(R_group).
    """
    r_B = jnp.asarray(rewards_B, jnp.float32)
    if r_B.ndim != 1 or r_B.shape[0] % group_size:
        raise ValueError(f"rewards of shape {r_B.shape} are not groups of {group_size}")
    r_PxG = r_B.reshape(-1, group_size)
    if group_size == 1:
        mean_Px1, std_Px1 = jnp.zeros_like(r_PxG), jnp.ones_like(r_PxG)
    else:
        mean_Px1 = r_PxG.mean(axis=1, keepdims=True)
        std_Px1 = r_PxG.std(axis=1, ddof=1, keepdims=True)
    adv_PxG = r_PxG - mean_Px1
    if normalize_std:
        adv_PxG = adv_PxG / (std_Px1 + 1e-6)
    return adv_PxG.reshape(-1)


def token_logp_and_entropy(logits_BxTxV, targets_BxT, temperature: float):
    """`(logp_BxT, entropy_BxT)` of p = softmax(logits / temperature), in float32.

    logp_{b,t} = log p_{b,t}(targets_{b,t});  H_{b,t} = -sum_v p_{b,t,v} log p_{b,t,v} (exact).
    The chosen token is picked by a compare-and-sum over V, which stays local under a vocab-sharded
    mesh (a gather along a sharded axis would not).
    """
    logp_BxTxV = jax.nn.log_softmax(logits_BxTxV.astype(jnp.float32) / temperature, axis=-1)
    vocab_V = jnp.arange(logits_BxTxV.shape[-1], dtype=targets_BxT.dtype)
    chosen_BxTxV = vocab_V == targets_BxT[..., None]
    logp_BxT = jnp.sum(jnp.where(chosen_BxTxV, logp_BxTxV, 0.0), axis=-1)
    entropy_BxT = -jnp.sum(jnp.exp(logp_BxTxV) * logp_BxTxV, axis=-1)
    return logp_BxT, entropy_BxT


def k3_kl(logp_BxT, ref_logp_BxT) -> jax.Array:
    """k3 estimator of KL(pi_theta || pi_ref) per token: exp(ref - logp) - (ref - logp) - 1 >= 0,
    clamped to [-10, 10] as the recipe's `low_var_kl` (a token beyond 10 then gives no gradient;
    only a run with β > 0 or a reference model computes it)."""
    d_BxT = ref_logp_BxT - logp_BxT
    return jnp.clip(jnp.exp(d_BxT) - d_BxT - 1.0, -_K3_LIMIT, _K3_LIMIT)


class Denominators(NamedTuple):
    """Denominators of one whole optimizer mini-batch (all micro-batches, all shards)."""

    loss: jax.Array  # token-mean: sum m; seq-mean-*: n_seqs; sum-norm: n_seqs * L_const
    tokens: jax.Array  # sum m, the denominator of every token-mean metric


def _check_agg_mode(agg_mode: str) -> None:
    if agg_mode not in AGG_MODES:
        raise ValueError(f"unknown agg_mode {agg_mode!r}; valid modes are {AGG_MODES}")


@dataclasses.dataclass(frozen=True)
class PolicyLossConfig:
    """The policy loss's knobs (static under jit), DAPO's values by default; checked once, here."""

    eps_low: float = 0.2  # ε_low
    eps_high: float = 0.28  # ε_high, Clip-Higher
    clip_ratio_c: float | None = None  # c, dual clip for A < 0 (DAPO scripts 10.0; None = off)
    agg_mode: str = "token-mean"  # one of AGG_MODES
    norm_const: float | None = None  # L_const of "seq-mean-token-sum-norm"
    beta: float = 0.0  # β, k3 KL to the reference (DAPO 0: no KL, no reference forward)
    entropy_coef: float = 0.0  # entropy bonus coefficient (DAPO 0)

    def __post_init__(self):
        _check_agg_mode(self.agg_mode)
        if self.clip_ratio_c is not None and self.clip_ratio_c <= 1.0:
            raise ValueError(f"dual-clip constant c must be > 1, got {self.clip_ratio_c}")


def sequence_loss_tokens(mask_BxT, segment_BxT=None) -> jax.Array:
    """`n_BxT`: the loss tokens of the response each token belongs to: its row's, or with
    `segment_BxT` (packed rows, `dapo_jax.packing`) its segment's, a run of one id along the row."""
    m_BxT = jnp.asarray(mask_BxT, jnp.float32)
    if segment_BxT is None:
        return jnp.broadcast_to(jnp.sum(m_BxT, axis=-1, keepdims=True), m_BxT.shape)
    t = m_BxT.shape[-1]
    cols_T = jnp.arange(t)
    before_BxT = jnp.pad(segment_BxT[:, :-1], ((0, 0), (1, 0)), constant_values=-1)
    after_BxT = jnp.pad(segment_BxT[:, 1:], ((0, 0), (0, 1)), constant_values=-1)
    first_BxT = jax.lax.cummax(jnp.where(segment_BxT != before_BxT, cols_T, 0), axis=1)
    last_BxT = jax.lax.cummin(jnp.where(segment_BxT != after_BxT, cols_T, t - 1), axis=1, reverse=True)
    sum_BxT = jnp.cumsum(m_BxT, axis=1)  # the segment's count: a difference of running sums
    at = lambda x_BxT, i_BxT: jnp.take_along_axis(x_BxT, i_BxT, axis=1)
    return at(sum_BxT, last_BxT) - at(sum_BxT, first_BxT) + at(m_BxT, first_BxT)


def denominators(mask_BxT, agg_mode: str, norm_const: float | None = None, segment_BxT=None) -> Denominators:
    """The denominators of `agg_mode` for the mini-batch whose loss mask is `mask_BxT`.

    n_seqs counts the responses with at least one loss token (rows; with `segment_BxT`, the
    segments of packed rows), so rows masked out entirely (overlong filtering, groups the
    dynamic-sampling filter left empty) weigh nothing. `norm_const` (L_const) is used by
    'seq-mean-token-sum-norm' only. An empty mini-batch gets denominators of 1 (loss 0).
    """
    _check_agg_mode(agg_mode)
    m_BxT = jnp.asarray(mask_BxT, jnp.float32)
    tokens = jnp.sum(m_BxT)
    if segment_BxT is None:
        n_seqs = jnp.sum(jnp.sum(m_BxT, axis=-1) > 0).astype(jnp.float32)
    else:  # each response's tokens add up to 1
        n_seqs = jnp.round(jnp.sum(m_BxT / jnp.maximum(sequence_loss_tokens(m_BxT, segment_BxT), 1.0)))
    if agg_mode == "token-mean":
        loss = tokens
    elif agg_mode in ("seq-mean-token-mean", "seq-mean-token-sum"):
        loss = n_seqs
    elif norm_const is None or norm_const <= 0:
        raise ValueError(
            "agg_mode 'seq-mean-token-sum-norm' needs norm_const = L_const > 0 "
            f"(the maximum response length), got {norm_const}"
        )
    else:
        loss = n_seqs * norm_const
    return Denominators(jnp.maximum(loss, 1.0), jnp.maximum(tokens, 1.0))


def clipped_surrogate(ratio_BxT, a_Bx1, eps_low: float, eps_high: float, clip_ratio_c: float | None):
    """`(l_pg_BxT, dual_BxT)`, the clipped surrogate per token (PPO's, with Clip-Higher and the
    dual clip) and where its dual clip binds:
        L1 = -A_i r_{i,t};  L2 = -A_i clip(r_{i,t}, 1 - ε_low, 1 + ε_high);  Lc = max(L1, L2)
        l_pg = min(Lc, -A_i c) where A_i < 0 and c is set (dual clip), else Lc."""
    pg_BxT = jnp.maximum(-a_Bx1 * ratio_BxT, -a_Bx1 * jnp.clip(ratio_BxT, 1.0 - eps_low, 1.0 + eps_high))
    if clip_ratio_c is None:
        return pg_BxT, jnp.zeros_like(pg_BxT, bool)
    dual_BxT = (a_Bx1 < 0) & (ratio_BxT > clip_ratio_c)
    return jnp.where(a_Bx1 < 0, jnp.minimum(pg_BxT, -a_Bx1 * clip_ratio_c), pg_BxT), dual_BxT


def _aggregations(on_BxT, agg_mode: str, denom: Denominators, segment_BxT):
    """`(agg, token_mean)`: x_BxT -> sum_{i,t} w x / denom.loss, with w_{i,t} = m_{i,t} or (for
    seq-mean-token-mean) m_{i,t} / sum_t m_{i,t}, and x_BxT -> sum_{i,t} m x / denom.tokens;
    masked entries replaced by 0, never multiplied (NaN there cannot leak)."""
    m_BxT = on_BxT.astype(jnp.float32)
    w_BxT = m_BxT
    if agg_mode == "seq-mean-token-mean":
        w_BxT = m_BxT / jnp.maximum(sequence_loss_tokens(m_BxT, segment_BxT), 1.0)
    agg = lambda x_BxT: jnp.sum(jnp.where(on_BxT, w_BxT * x_BxT, 0.0)) / denom.loss
    token_mean = lambda x_BxT: jnp.sum(jnp.where(on_BxT, x_BxT, 0.0)) / denom.tokens
    return agg, token_mean


def policy_loss_sum(
    logp_BxT,
    old_logp_BxT,
    adv_B,
    mask_BxT,
    denom: Denominators,
    cfg: PolicyLossConfig,
    *,
    ref_logp_BxT=None,
    entropy_BxT=None,
    is_weight_BxT=None,
    segment_BxT=None,
):
    """These rows' share of the mini-batch loss: sums over their tokens / the mini-batch's `denom`.

    Per token, with r = exp(logp - old_logp) (log r clamped to ±20) and l_pg the clipped
    surrogate (`clipped_surrogate`):
        l = ρ_{i,t} l_pg + β KL_k3(pi_theta || pi_ref) - entropy_coef H
    with ρ_{i,t} = `is_weight_BxT`, constants (the mismatch correction's truncated importance
    weights pi_old / pi_sampler, `rollout_correction`; 1 without them), and ε_low, ε_high, c, β,
    entropy_coef from `cfg` (its norm_const enters through `denom`).
    Aggregated with weights w_{i,t} = m_{i,t} (token-mean, seq-mean-token-sum[-norm]) or
    m_{i,t} / sum_t m_{i,t} (seq-mean-token-mean):  loss = sum_{i,t} w l / denom.loss.
    Packed rows (`dapo_jax.packing`): `adv_B` per token (`_BxT`) and the responses the segments
    of `segment_BxT` (sum_t then runs over a segment, `sequence_loss_tokens`).

    Zero-gradient tokens: upper clip (A > 0, r > 1 + ε_high), lower clip (A < 0, r < 1 - ε_low),
    dual clip (A < 0, r > c). Returns `(loss, metrics)`, metrics a dict of scalars: pg_loss
    (aggregated like the loss), and token-means over the mask (/ denom.tokens): the three clip
    fractions, approx_kl_old (k3 of KL(pi_old || pi_theta): r - 1 - log r), token_prob (exp(logp)),
    kl_ref when `ref_logp_BxT` is given, entropy when `entropy_BxT` is given.
    """
    eps_low, eps_high = cfg.eps_low, cfg.eps_high
    on_BxT = jnp.asarray(mask_BxT, bool)
    a_Bx1 = jnp.asarray(adv_B, jnp.float32)  # (B x T for packed rows: A_i on each token)
    a_Bx1 = a_Bx1 if a_Bx1.ndim == 2 else a_Bx1[:, None]
    # Masked entries are replaced, not multiplied by 0, so junk (even NaN) there cannot leak.
    log_ratio_BxT = jnp.clip(
        jnp.where(on_BxT, logp_BxT - old_logp_BxT, 0.0), -_LOG_RATIO_LIMIT, _LOG_RATIO_LIMIT
    )
    ratio_BxT = jnp.exp(log_ratio_BxT)

    pg_BxT, dual_BxT = clipped_surrogate(ratio_BxT, a_Bx1, eps_low, eps_high, cfg.clip_ratio_c)
    if is_weight_BxT is not None:
        pg_BxT = pg_BxT * jax.lax.stop_gradient(is_weight_BxT)
    agg, token_mean = _aggregations(on_BxT, cfg.agg_mode, denom, segment_BxT)

    metrics = {
        "pg_loss": agg(pg_BxT),
        "pg_clipfrac_upper": token_mean((a_Bx1 > 0) & (ratio_BxT > 1.0 + eps_high)),
        "pg_clipfrac_lower": token_mean((a_Bx1 < 0) & (ratio_BxT < 1.0 - eps_low)),
        "pg_clipfrac_dual": token_mean(dual_BxT),
        "approx_kl_old": token_mean(ratio_BxT - 1.0 - log_ratio_BxT),
        "token_prob": token_mean(jnp.exp(logp_BxT)),
    }
    reg_BxT, reg_metrics = _regularizers(cfg, on_BxT, token_mean, logp_BxT, ref_logp_BxT, entropy_BxT)
    loss = agg(pg_BxT + reg_BxT)
    return loss, {**metrics, **reg_metrics, "loss": loss}


def _regularizers(cfg: PolicyLossConfig, on_BxT, token_mean, logp_BxT, ref_logp_BxT, entropy_BxT):
    """`(reg_BxT, metrics)`: β KL_k3(pi_theta || pi_ref) - entropy_coef H per token (0 where
    both are off), and the token-means kl_ref and entropy of what is given."""
    if cfg.beta and ref_logp_BxT is None:
        raise ValueError(f"beta = {cfg.beta} needs ref_logp_BxT")
    if cfg.entropy_coef and entropy_BxT is None:
        raise ValueError(f"entropy_coef = {cfg.entropy_coef} needs entropy_BxT")
    reg_BxT, metrics = jnp.zeros_like(logp_BxT, jnp.float32), {}
    if ref_logp_BxT is not None:
        kl_BxT = k3_kl(jnp.where(on_BxT, logp_BxT, 0.0), jnp.where(on_BxT, ref_logp_BxT, 0.0))
        metrics["kl_ref"] = token_mean(kl_BxT)
        if cfg.beta:
            reg_BxT = reg_BxT + cfg.beta * kl_BxT
    if entropy_BxT is not None:
        metrics["entropy"] = token_mean(entropy_BxT)
        if cfg.entropy_coef:
            reg_BxT = reg_BxT - cfg.entropy_coef * jnp.where(on_BxT, entropy_BxT, 0.0)
    return reg_BxT, metrics


def logp_diff(logp_BxT, other_logp_BxT, mask_BxT, denom: Denominators):
    """`(sum, max)` of |logp - other_logp| over the masked tokens, the sum / denom.tokens: these
    rows' share of the mini-batch's mean difference, and their largest (0 without a token)."""
    on_BxT = jnp.asarray(mask_BxT, bool)
    d_BxT = jnp.where(on_BxT, jnp.abs(logp_BxT - other_logp_BxT), 0.0)
    return jnp.sum(d_BxT) / denom.tokens, jnp.max(d_BxT, initial=0.0)


def policy_loss(
    logp_BxT,
    old_logp_BxT,
    adv_B,
    mask_BxT,
    cfg: PolicyLossConfig = PolicyLossConfig(),
    *,
    ref_logp_BxT=None,
    entropy_BxT=None,
    is_weight_BxT=None,
    segment_BxT=None,
):
    """The loss of one whole mini-batch: `policy_loss_sum` over its own `denominators`.

    `cfg.agg_mode` (section 3):  token-mean: sum_{i,t} l m / sum_{i,t} m;
    seq-mean-token-mean: mean_i (sum_t l m / sum_t m);  seq-mean-token-sum (the recipe's):
    mean_i sum_t l m;  seq-mean-token-sum-norm: sum_{i,t} l m / (n_seqs L_const) with
    L_const = `cfg.norm_const`. The means over i count rows with a loss token. Returns `(loss, metrics)`.
    """
    denom = denominators(mask_BxT, cfg.agg_mode, cfg.norm_const, segment_BxT)
    return policy_loss_sum(
        logp_BxT,
        old_logp_BxT,
        adv_B,
        mask_BxT,
        denom,
        cfg,
        ref_logp_BxT=ref_logp_BxT,
        entropy_BxT=entropy_BxT,
        is_weight_BxT=is_weight_BxT,
        segment_BxT=segment_BxT,
    )

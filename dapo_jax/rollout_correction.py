"""Training-inference mismatch correction (verl's `algorithm.rollout_correction`, decoupled mode).

The sampler (a bf16, tensor-parallel decode) and the trainer (other layouts, other reductions)
give different log-probs for the same tokens, so the responses are drawn from pi_sampler, not from
the pi_old that the clipped ratio r = pi_θ / pi_old takes as the behaviour policy. Per token,
    log ρ_t = log pi_old(o_t) - log pi_sampler(o_t)          (clamped to ±20, as verl)
and, with m_t the loss mask of the row:
  importance sampling (`rollout_is`), a weight w_t on each token's policy-gradient term:
    "token":    w_t = min(ρ_t, τ)                  truncated IS, τ = `rollout_is_threshold` (2.0)
    "sequence": w_t = min(prod_t' ρ_t'^m_t', τ)    one weight per response
  rejection (`rollout_rs`), tokens taken out of the loss mask (and so out of the denominators):
    "token":     token t dropped when ρ_t is outside [lower, upper]
    "sequence":  the response dropped when prod_t ρ_t is outside [lower, upper]
    "geometric": the response dropped when exp(mean_t log ρ_t) is outside [lower, upper]
  with upper = `rollout_rs_threshold`, lower = `rollout_rs_threshold_lower` (0: 1 / upper).
The weights are constants (no gradient: both log-probs are fixed before the updates). Off by
default: the DAPO reproduction recipe has no correction.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

IS_LEVELS = ("token", "sequence")  # or None: no importance weights
RS_LEVELS = ("token", "sequence", "geometric")  # or None: no rejection
_LOG_LIMIT = 20.0  # |log ρ| bound, so that exp cannot overflow (verl's safety bound)


@dataclasses.dataclass(frozen=True, kw_only=True)
class CorrectionConfig:
    """The correction's knobs, verl's names (`algorithm.rollout_correction.*`); static under jit."""

    rollout_is: str | None = None  # one of IS_LEVELS (None: off)
    rollout_is_threshold: float = 2.0  # τ, the truncation of the IS weights
    rollout_rs: str | None = None  # one of RS_LEVELS (None: off)
    rollout_rs_threshold: float = 2.0  # upper bound of the accepted ratios
    rollout_rs_threshold_lower: float | None = None  # lower bound (None: 1 / rollout_rs_threshold)

    def __post_init__(self):
        if self.rollout_is not in (None, *IS_LEVELS):
            raise ValueError(f"unknown rollout_is {self.rollout_is!r}; use one of {IS_LEVELS} or None")
        if self.rollout_rs not in (None, *RS_LEVELS):
            raise ValueError(f"unknown rollout_rs {self.rollout_rs!r}; use one of {RS_LEVELS} or None")
        if self.rollout_is and self.rollout_is_threshold <= 0:
            raise ValueError(f"rollout_is_threshold must be > 0, got {self.rollout_is_threshold}")
        lower = self.rollout_rs_threshold_lower
        if self.rollout_rs and lower is not None and not 0 < lower < self.rollout_rs_threshold:
            raise ValueError(
                f"rollout_rs needs 0 < rollout_rs_threshold_lower < rollout_rs_threshold, got "
                f"{lower} and {self.rollout_rs_threshold}"
            )

    @property
    def corrects(self) -> bool:
        """Whether any correction is on (the update then needs the sampler's log-probs)."""
        return bool(self.rollout_is or self.rollout_rs)


class Correction(NamedTuple):
    is_weight_BxT: jax.Array  # w_t over the kept tokens, 0 elsewhere (1 where rollout_is is off)
    loss_mask_BxT: jax.Array  # bool, the loss mask after rejection
    metrics: dict  # rollout_corr/* scalars


def correct(cfg: CorrectionConfig, old_logp_BxT, sampler_logp_BxT, loss_mask_BxT) -> Correction:
    """The IS weights, the rejection mask and their metrics, over the tokens of `loss_mask_BxT`.

    Metrics (verl's names, token means over the loss mask before rejection unless said):
    rollout_corr/rollout_is_mean (the applied weights, over the kept tokens), rollout_is_max (the
    ratio before truncation: ρ_t or prod ρ), rollout_is_ratio_fraction_high (the fraction
    truncated), rollout_rs_masked_fraction (tokens rejected), rollout_rs_seq_masked_fraction
    (responses with a rejected token, over the responses with a loss token), kl (mean of
    log pi_sampler - log pi_old) and k3_kl (mean of ρ - 1 - log ρ).
    """
    on_BxT = jnp.asarray(loss_mask_BxT, bool)
    m_BxT = on_BxT.astype(jnp.float32)
    log_rho_BxT = jnp.where(on_BxT, old_logp_BxT - sampler_logp_BxT, 0.0)
    log_seq_Bx1 = jnp.sum(log_rho_BxT, axis=-1, keepdims=True)
    n_Bx1 = jnp.sum(m_BxT, axis=-1, keepdims=True)
    bound = lambda x: jnp.exp(jnp.clip(x, -_LOG_LIMIT, _LOG_LIMIT))
    rho_BxT, rho_seq_Bx1 = bound(log_rho_BxT), bound(log_seq_Bx1)
    tokens, rows = jnp.maximum(jnp.sum(m_BxT), 1.0), n_Bx1[:, 0] > 0
    mean = lambda x_BxT, on=on_BxT: jnp.sum(jnp.where(on, x_BxT, 0.0)) / jnp.maximum(jnp.sum(on), 1)

    keep_BxT = on_BxT
    if cfg.rollout_rs:
        upper = cfg.rollout_rs_threshold
        lower = 1.0 / upper if cfg.rollout_rs_threshold_lower is None else cfg.rollout_rs_threshold_lower
        outside = lambda r: (r > upper) | (r < lower)
        if cfg.rollout_rs == "token":
            keep_BxT = on_BxT & ~outside(rho_BxT)
        else:
            log_Bx1 = log_seq_Bx1 if cfg.rollout_rs == "sequence" else log_seq_Bx1 / jnp.maximum(n_Bx1, 1.0)
            keep_BxT = on_BxT & ~outside(bound(log_Bx1))
    metrics = {
        "rollout_corr/kl": mean(-log_rho_BxT),
        "rollout_corr/k3_kl": mean(rho_BxT - 1.0 - log_rho_BxT),
        "rollout_corr/rollout_rs_masked_fraction": jnp.sum(on_BxT & ~keep_BxT) / tokens,
        "rollout_corr/rollout_rs_seq_masked_fraction": jnp.sum(jnp.any(on_BxT & ~keep_BxT, axis=-1))
        / jnp.maximum(jnp.sum(rows), 1),
    }
    weight_BxT = jnp.ones_like(m_BxT)
    if cfg.rollout_is:
        ratio_BxT = rho_BxT if cfg.rollout_is == "token" else jnp.broadcast_to(rho_seq_Bx1, m_BxT.shape)
        weight_BxT = jnp.minimum(ratio_BxT, cfg.rollout_is_threshold)
        metrics.update(
            {
                "rollout_corr/rollout_is_mean": mean(weight_BxT, keep_BxT),
                "rollout_corr/rollout_is_max": jnp.max(jnp.where(on_BxT, ratio_BxT, 0.0)),
                "rollout_corr/rollout_is_ratio_fraction_high": mean(ratio_BxT > cfg.rollout_is_threshold),
            }
        )
    return Correction(jnp.where(keep_BxT, weight_BxT, 0.0), keep_BxT, metrics)

"""A training step's metrics from its host-side records: the trained rows' data/*, the sampler's
agreement with log pi_old (rollout/logp_diff_*), the updates' actor/*, and timing/* and
throughput/* (docs/dapo_spec.md section 10 names them; `metrics.RECIPE_NAMES` maps them to the
recipe's)."""

from __future__ import annotations

import numpy as np

from dapo_jax import train_step
from dapo_jax.records import TrainBatch


def data_metrics(batch: TrainBatch) -> dict:
    """Score, reward, accuracy, length and truncation of the rows trained on (after the filter)."""
    v = batch.valid_B
    if not v.any():
        return {}
    rows = batch.rows.rows(v)
    return {
        "data/score_mean": float(rows.score_B.mean()),
        "data/reward_mean": float(rows.reward_B.mean()),
        "data/acc_mean": float(rows.acc_B.mean()),
        "data/response_length_mean": float(rows.length_B.mean()),
        "data/response_length_max": float(rows.length_B.max()),
        "data/response_length_min": float(rows.length_B.min()),
        "data/truncated_fraction": float(rows.truncated_B.mean()),
    }


def logp_agreement(
    sampler_logp_BxN: np.ndarray,
    prompt_len: int,
    old_logp_BxT: np.ndarray,
    loss_mask_BxT: np.ndarray,
    carried_B: np.ndarray,
) -> dict:
    """|log pi_sampler - log pi_old| over the trained response tokens (the columns of T after
    the `prompt_len` prompt ones): the importance ratio of the first update is exactly 1 only if
    the sampler and the trainer agree (docs/dapo_spec.md section 2). Rows of `carried_B` (groups
    carried over from the last step, sampled under the policy before its update) are measured
    apart: their difference is the update's, not a mismatch."""
    mask_BxN = loss_mask_BxT[:, prompt_len:]
    diff_BxN = np.abs(sampler_logp_BxN[:, : mask_BxN.shape[1]] - old_logp_BxT[:, prompt_len:])
    out = {}
    fresh = diff_BxN[~carried_B][mask_BxN[~carried_B]]
    if fresh.size:
        out.update(
            {"rollout/logp_diff_mean": float(fresh.mean()), "rollout/logp_diff_max": float(fresh.max())}
        )
    carried = diff_BxN[carried_B][mask_BxN[carried_B]]
    if carried.size:
        out["rollout/carried_logp_diff_mean"] = float(carried.mean())
    return out


def speed_metrics(batch: TrainBatch, host: train_step.Rollout, seconds: dict, reward_totals: dict) -> dict:
    """timing/* (the step's `seconds` by phase), throughput/* and the reward scorer's running
    totals (`RewardScorer.totals`)."""
    return {
        **{f"timing/{phase}_s": t for phase, t in seconds.items()},
        "throughput/sample_tokens_per_s": float(batch.rows.length_B.sum()) / max(seconds["rollout"], 1e-9),
        "throughput/train_tokens_per_s": float(host.mask_BxT.sum()) / max(seconds["train"], 1e-9),
        "reward/errors_total": reward_totals["n_error"],
        "reward/timeouts_total": reward_totals["n_timeout"],
    }


def actor_metrics(updates: list[dict]) -> dict:
    """actor/*: the step's updates' metrics averaged over its mini-batches (not logp_diff_*: the
    sampler check reads the first update's) and actor/skipped_updates, their count of skips."""
    out = {
        f"actor/{k}": float(np.mean([u[k] for u in updates]))
        for k in updates[0]
        if not k.startswith("logp_diff")
    }
    out["actor/skipped_updates"] = int(sum(u["skipped"] for u in updates))
    return out

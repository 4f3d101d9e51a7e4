"""Dynamic sampling (docs/dapo_spec.md section 5): host-side group filter. Pure numpy; no jax.

A generation batch holds G responses for each of its prompts, the rows of one prompt's group
contiguous. A group keeps signal only when its filter metric is not all-equal,
    keep_g = std_i(metric_{g,i}) > 0      (for acc: 0 < sum_i acc_{g,i} < G),
judged by default on `acc`, the binary correctness, never on the shaped reward R_i (all-wrong
groups that differ only by overlong penalty would survive with spurious advantages); `metric`
may also name "score" or "reward", as the recipe's `filter_groups.metric` may. A group of one
(G = 1) is kept: its std is 0 by definition, not for want of signal, and its advantage is its
reward (objective.group_advantages); the recipe keeps it too, and dropping it would leave G = 1
runs with nothing to train on. Generation batches are drawn until P (the train batch's) groups are
kept, then exactly P whole groups are taken. At most `max_num_gen_batches` are drawn per step (None:
no bound, the recipe's `max_num_gen_batches <= 0`); when that bound is hit the step still gets a
full-shape batch in which the missing groups are zero rows with valid_B False (or an error,
on_exhausted="raise", the recipe's behaviour).

Cost model: with a fraction p of prompts keeping signal, filling P groups takes P/p prompts on
average; for per-prompt pass rate q, p = 1 - q^G - (1-q)^G.

Kept groups beyond P are discarded by default (carry_over=False), as in the DAPO recipe: each
step then trains only on responses of the current policy and reproduces the recipe's sampling.
carry_over=True keeps them for the next step (at most one generation batch of them), saving
generation at the price of training on groups one policy update old; `state()`/`restore()` put
them in a checkpoint.
"""

import logging

import numpy as np

from dapo_jax.records import GenerationBatch, TrainBatch, concat

FILTER_METRICS = ("acc", "score", "reward")
ON_EXHAUSTED = ("mask", "raise")
# Per-row fields whose mean over every generated row is logged as before_filter/{name}_mean.
_LOGGED = ("acc", "score", "reward", "length", "truncated")


class DynamicSampler:
    """An accumulator of kept groups: `add` generation batches while neither `full` nor
    `bound_reached`, then `take` one train batch of P = train_batch_prompts whole groups of G
    rows (B = P x G).

    `take()` returns (TrainBatch, stats): groups carried over from the last `take` come first
    (`carried_B` marks them), then this step's in generation order; when the bound was hit
    first, zero rows with `valid_B` False stand in for the missing groups. enable=False
    is the GRPO baseline: groups are taken as they come, all-equal ones included.
    """

    def __init__(
        self,
        train_batch_prompts: int,
        group_size: int,
        max_num_gen_batches: int | None,
        *,
        enable: bool,
        metric: str,
        carry_over: bool,
        on_exhausted: str,
    ):
        if (
            train_batch_prompts < 1
            or group_size < 1
            or (max_num_gen_batches is not None and max_num_gen_batches < 1)
        ):
            raise ValueError(
                "train_batch_prompts, group_size and max_num_gen_batches (None: no bound) must be >= 1"
            )
        if on_exhausted not in ON_EXHAUSTED:
            raise ValueError(f"on_exhausted must be one of {ON_EXHAUSTED}, got {on_exhausted!r}")
        if metric not in FILTER_METRICS:
            raise ValueError(f"filter metric must be one of {FILTER_METRICS}, got {metric!r}")
        self._P, self._G = train_batch_prompts, group_size  # P groups of G responses
        self._max_num_gen_batches = max_num_gen_batches
        self._filter, self._metric, self._carry_over = enable, metric, carry_over
        self._on_exhausted = on_exhausted
        self._carry: GenerationBatch | None = None  # kept groups not yet trained on
        self._generated: list[GenerationBatch] = []  # this step's generation batches
        self._kept_P: list[np.ndarray] = []  # and which of their groups were kept

    @property
    def num_kept(self) -> int:
        """Groups kept so far for the next `take`, carried ones included."""
        carried = self._carry.num_rows // self._G if self._carry is not None else 0
        return carried + sum(int(k.sum()) for k in self._kept_P)

    @property
    def kept_P(self) -> np.ndarray:
        """Which groups of this step's generation batches were kept so far, in order."""
        return np.concatenate(self._kept_P) if self._kept_P else np.zeros(0, bool)

    @property
    def full(self) -> bool:
        return self.num_kept >= self._P

    @property
    def bound_reached(self) -> bool:
        """max_num_gen_batches generation batches added since the last `take` (never, at None)."""
        return self._max_num_gen_batches is not None and len(self._generated) >= self._max_num_gen_batches

    def add(self, batch: GenerationBatch) -> None:
        """One generation batch of whole groups; its groups with signal are kept."""
        if batch.num_rows == 0 or batch.num_rows % self._G:
            raise ValueError(
                f"a generation batch needs a positive multiple of G={self._G} rows; got {batch.num_rows}"
            )
        self._generated.append(batch)
        self._kept_P.append(self._keep(getattr(batch, f"{self._metric}_B")))
        if self._max_num_gen_batches is None and len(self._generated) % 10 == 0 and not self.full:
            logging.warning(
                "dynamic sampling: %d of %d groups kept after %d generation batches "
                "(max_num_gen_batches = None: no bound)",
                self.num_kept,
                self._P,
                len(self._generated),
            )

    def take(self) -> tuple[TrainBatch, dict]:
        """The train batch of B = P x G rows and its statistics (see `_stats`); starts the next step."""
        n_kept = self.num_kept
        n_masked = max(self._P - n_kept, 0)
        if n_masked and self._on_exhausted == "raise":
            raise RuntimeError(
                f"dynamic sampling kept {n_kept} of {self._P} groups after "
                f"{len(self._generated)} generation batches (max_num_gen_batches)"
            )
        carried = self._carry.num_rows if self._carry is not None else 0
        pieces = [self._carry] if self._carry is not None else []
        pieces += [g.rows(np.repeat(k, self._G)) for g, k in zip(self._generated, self._kept_P)]
        if not pieces:
            raise RuntimeError("take() needs an add() first, or groups carried over")
        kept = concat(pieces)
        rows = self._P * self._G
        batch = kept.rows(slice(None, rows)).with_zero_rows(n_masked * self._G)
        leftover = kept.rows(slice(rows, None))
        n_leftover = leftover.num_rows // self._G
        stats = self._stats(n_carried_in=carried // self._G, n_masked=n_masked, n_leftover=n_leftover)
        self._carry = leftover if self._carry_over and n_leftover else None
        self._generated, self._kept_P = [], []
        row_B = np.arange(rows)
        return TrainBatch(
            batch, valid_B=row_B < (self._P - n_masked) * self._G, carried_B=row_B < carried
        ), stats

    def _keep(self, metric_B) -> np.ndarray:
        """Per group: does it go into the batch? Not all-equal, or G = 1, or no filtering."""
        metric_PxG = np.asarray(metric_B, np.float64).reshape(-1, self._G)
        if not self._filter or self._G == 1:
            return np.ones(len(metric_PxG), bool)
        return (metric_PxG != metric_PxG[:, :1]).any(axis=1)  # std > 0

    def _stats(self, n_carried_in: int, n_masked: int, n_leftover: int) -> dict:
        """Filter statistics of one step. Fractions are over the P groups generated this step
        (NaN when it drew none, served from carried groups); before_filter/ means are over
        every generated row."""
        generated = concat(self._generated) if self._generated else None
        acc_PxG = (
            generated.acc_B.reshape(-1, self._G) if generated is not None else np.zeros((0, self._G), bool)
        )
        kept_P = self.kept_P
        n_groups = len(acc_PxG)
        fraction = lambda x: float(x.sum() / n_groups) if n_groups else float("nan")
        stats = {
            "dynamic_sampling/kept_fraction": fraction(kept_P),
            "dynamic_sampling/all_correct_fraction": fraction(acc_PxG.all(1)),
            "dynamic_sampling/all_wrong_fraction": fraction(~acc_PxG.any(1)),
            "dynamic_sampling/gen_batches": len(self._generated),
            "dynamic_sampling/prompts_consumed": n_groups,
            "dynamic_sampling/groups_carried_in": n_carried_in,
            "dynamic_sampling/groups_masked": n_masked,
            "dynamic_sampling/exhausted": n_masked > 0,
            "dynamic_sampling/groups_carried_out": n_leftover if self._carry_over else 0,
            "dynamic_sampling/groups_discarded": 0 if self._carry_over else n_leftover,
        }
        for name in _LOGGED:
            stats[f"before_filter/{name}_mean"] = (
                float(getattr(generated, f"{name}_B").mean()) if generated is not None else float("nan")
            )
        return stats

    def state(self) -> dict:
        """Checkpointable state: the carried groups as a dict of numpy arrays (empty if none)."""
        return {"carry": self._carry.to_arrays() if self._carry is not None else {}}

    def restore(self, state: dict):
        carry = state["carry"]
        self._carry = GenerationBatch.from_arrays(carry) if carry else None

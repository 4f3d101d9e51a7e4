"""Dynamic sampling (DAPO spec section 5): host-side group filter. Pure numpy; no jax.

A generation batch holds G responses for each of its prompts, the rows of one prompt's group
contiguous. A group keeps signal only when its filter metric is not all-equal,
    keep_g = std_i(metric_{g,i}) > 0      (for acc: 0 < sum_i acc_{g,i} < G),
judged by default on `acc`, the binary correctness, never on the shaped reward R_i (all-wrong
groups that differ only by overlong penalty would survive with spurious advantages); `metric`
may also name "score" or "reward", as the recipe's `filter_groups.metric` may. A group of one
(G = 1) is kept: its std is 0 by definition, not for want of signal, and its advantage is its
reward (objective.group_advantages); the recipe keeps it too, and dropping it would leave G = 1
runs with nothing to train on. Generation batches are drawn until B (train batch) groups are
kept, then exactly B whole groups are taken. At most `max_num_gen_batches` are drawn per step (0:
no bound, as the recipe's `max_num_gen_batches <= 0`); when that bound is hit the step still gets a
full-shape batch in which the missing groups are zero rows with valid=False (or an error,
on_exhausted="raise", the recipe's behaviour).

Cost model: with a fraction p of prompts keeping signal, filling B groups takes B/p prompts on
average; for per-prompt pass rate q, p = 1 - q^G - (1-q)^G.

Kept groups beyond B are discarded by default (carry_over=False), as in the DAPO recipe: each
step then trains only on responses of the current policy and reproduces the recipe's sampling.
carry_over=True keeps them for the next step (at most one generation batch of them), saving
generation at the price of training on groups one policy update old; `state()`/`restore()` put
them in a checkpoint.
"""

import logging

import numpy as np

FILTER_METRICS = ("acc", "score", "reward")


class DynamicSampler:
    """Fills train batches of B = train_batch_groups whole groups of G rows from `generate_fn`.

    generate_fn() -> dict of numpy arrays, leading dim n_prompts*G, including "acc" (bool) and
    the filter `metric`.
    Every other key (tokens, scores, lengths, ...) is carried through untouched, sliced by whole
    groups. `next_batch()` returns (batch, stats): the batch has leading dim B*G and an added
    bool key "valid" per row; groups carried over from the last call come first (stats
    "dynamic_sampling/groups_carried_in" of them), then this call's in generation order.
    filter_groups=False is the GRPO baseline: groups are taken as they come, all-equal ones
    included.
    """

    def __init__(self, generate_fn, train_batch_groups: int, group_size: int,
                 max_num_gen_batches: int = 10, *, filter_groups: bool = True,
                 metric: str = "acc", carry_over: bool = False, on_exhausted: str = "mask",
                 metric_keys: tuple = ("acc", "score", "reward", "length", "truncated")):
        if train_batch_groups < 1 or group_size < 1 or max_num_gen_batches < 0:
            raise ValueError("train_batch_groups and group_size must be >= 1 and "
                             "max_num_gen_batches >= 0 (0: no bound)")
        if on_exhausted not in ("mask", "raise"):
            raise ValueError(f"on_exhausted must be 'mask' or 'raise', got {on_exhausted!r}")
        if metric not in FILTER_METRICS:
            raise ValueError(f"filter metric must be one of {FILTER_METRICS}, got {metric!r}")
        self._generate_fn = generate_fn
        self._B, self._G = train_batch_groups, group_size           # B groups of G responses
        self._max_num_gen_batches = max_num_gen_batches
        self._filter, self._metric, self._carry_over = filter_groups, metric, carry_over
        self._on_exhausted, self._metric_keys = on_exhausted, metric_keys
        self._carry = {}  # kept groups not yet trained on, rows group-contiguous
        self._keys = None  # the keys of the first generation batch; all must match

    def _num_groups(self, arrays: dict) -> int:
        return len(arrays["acc"]) // self._G if arrays else 0

    def _checked(self, gen: dict) -> dict:
        if "acc" not in gen or self._metric not in gen or "valid" in gen:
            raise ValueError(f"generate_fn must return 'acc' and {self._metric!r} and not "
                             f"'valid'; got {sorted(gen)}")
        gen = {k: np.asarray(v) for k, v in gen.items()}
        n, shapes = len(gen["acc"]), {k: v.shape for k, v in gen.items()}
        if n == 0 or n % self._G or any(shape[:1] != (n,) for shape in shapes.values()):
            raise ValueError(f"generate_fn arrays need one leading dim, a positive multiple of "
                             f"G={self._G}; got {shapes}")
        self._keys = self._keys or set(self._carry) or set(gen)
        if set(gen) != self._keys:
            raise ValueError(f"generation batch keys {sorted(gen)} differ from earlier ones "
                             f"{sorted(self._keys)}")
        return gen

    def next_batch(self) -> tuple[dict, dict]:
        """One train batch of B*G rows and its statistics (see `_stats`)."""
        pieces = [self._carry] if self._carry else []
        n_carried_in = self._num_groups(self._carry)
        n_kept, generated, kept_masks = n_carried_in, [], []
        bound = self._max_num_gen_batches or float("inf")
        while n_kept < self._B and len(generated) < bound:
            gen = self._checked(self._generate_fn())
            keep_P = self._keep(gen[self._metric])
            rows = np.repeat(keep_P, self._G)
            pieces.append({k: v[rows] for k, v in gen.items()})
            generated.append(gen)
            kept_masks.append(keep_P)
            n_kept += int(keep_P.sum())
            if not self._max_num_gen_batches and len(generated) % 10 == 0 and n_kept < self._B:
                logging.warning("dynamic sampling: %d of %d groups kept after %d generation "
                                "batches (max_num_gen_batches = 0: no bound)", n_kept, self._B,
                                len(generated))
        kept = {k: np.concatenate([p[k] for p in pieces]) for k in pieces[0]}
        n_masked = max(self._B - n_kept, 0)
        if n_masked and self._on_exhausted == "raise":
            raise RuntimeError(f"dynamic sampling kept {n_kept} of {self._B} groups after "
                               f"{len(generated)} generation batches (max_num_gen_batches)")
        rows = self._B * self._G
        batch = {k: v[:rows] for k, v in kept.items()}
        leftover = {k: v[rows:] for k, v in kept.items()}
        self._carry = leftover if self._carry_over and self._num_groups(leftover) else {}
        if n_masked:
            batch = {k: np.concatenate([v, np.zeros((n_masked * self._G,) + v.shape[1:], v.dtype)])
                     for k, v in batch.items()}
        batch["valid"] = np.arange(rows) < (self._B - n_masked) * self._G
        stats = self._stats(generated, kept_masks, batch, n_carried_in, n_masked,
                            n_leftover=self._num_groups(leftover))
        return batch, stats

    def _keep(self, metric_B) -> np.ndarray:
        """Per group: does it go into the batch? Not all-equal, or G = 1, or no filtering."""
        metric_PxG = np.asarray(metric_B, np.float64).reshape(-1, self._G)
        if not self._filter or self._G == 1:
            return np.ones(len(metric_PxG), bool)
        return (metric_PxG != metric_PxG[:, :1]).any(axis=1)  # std > 0

    def _stats(self, generated, kept_masks, batch, n_carried_in, n_masked, n_leftover) -> dict:
        """Filter and data statistics of one step. Fractions are over the P groups generated
        this step (NaN when it drew none, served from carried groups). Data metrics, for each
        per-row key in `metric_keys`: before_filter/ over every generated row, after_filter/
        over the valid rows of the returned batch (carried groups included)."""
        acc_PxG = (np.concatenate([g["acc"] for g in generated]).astype(bool).reshape(-1, self._G)
                   if generated else np.zeros((0, self._G), bool))
        kept_P = np.concatenate(kept_masks) if kept_masks else np.zeros(0, bool)
        n_groups = len(acc_PxG)
        fraction = lambda x: float(x.sum() / n_groups) if n_groups else float("nan")
        stats = {
            "dynamic_sampling/kept_fraction": fraction(kept_P),
            "dynamic_sampling/all_correct_fraction": fraction(acc_PxG.all(1)),
            "dynamic_sampling/all_wrong_fraction": fraction(~acc_PxG.any(1)),
            "dynamic_sampling/gen_batches": len(generated),
            "dynamic_sampling/prompts_consumed": n_groups,
            "dynamic_sampling/groups_carried_in": n_carried_in,
            "dynamic_sampling/groups_masked": n_masked,
            "dynamic_sampling/exhausted": n_masked > 0,
            "dynamic_sampling/groups_carried_out": n_leftover if self._carry_over else 0,
            "dynamic_sampling/groups_discarded": 0 if self._carry_over else n_leftover,
        }
        valid = batch["valid"]
        for key in self._metric_keys:
            if key in batch and batch[key].ndim == 1:
                before = np.concatenate([g[key] for g in generated]) if generated else np.zeros(0)
                stats[f"before_filter/{key}_mean"] = (float(before.mean()) if len(before)
                                                      else float("nan"))
                stats[f"after_filter/{key}_mean"] = (float(batch[key][valid].mean()) if valid.any()
                                                     else float("nan"))
        return stats

    def state(self) -> dict:
        """Checkpointable state: the carried groups as a dict of numpy arrays (empty if none)."""
        return {"carry": {k: np.array(v) for k, v in self._carry.items()}}

    def restore(self, state: dict):
        self._carry = {k: np.asarray(v) for k, v in state["carry"].items()}

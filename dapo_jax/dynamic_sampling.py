"""Dynamic sampling (DAPO spec section 5): host-side group filter. Pure numpy; no jax.

A generation batch holds G responses for each of its prompts, the rows of one prompt's group
contiguous. A group keeps signal only when its binary correctness is not all-equal,
    keep_g = 0 < sum_i acc_{g,i} < G        (population std of acc > 0),
judged on `acc`, never on the shaped reward R_i (all-wrong groups that differ only by overlong
penalty would survive with spurious advantages). Generation batches are drawn until B (train
batch) groups are kept, then exactly B whole groups are taken. At most `max_num_gen_batches`
are drawn per step; when that bound is hit the step still gets a full-shape batch in which the
missing groups are zero rows with valid=False (or an error, on_exhausted="raise").

Cost model: with a fraction p of prompts keeping signal, filling B groups takes B/p prompts on
average; for per-prompt pass rate q, p = 1 - q^G - (1-q)^G.

Kept groups beyond B are discarded by default (carry_over=False), as in the DAPO recipe: each
step then trains only on responses of the current policy and reproduces the recipe's sampling.
carry_over=True keeps them for the next step (at most one generation batch of them), saving
generation at the price of training on groups one policy update old; `state()`/`restore()` put
them in a checkpoint.
"""

import numpy as np


class DynamicSampler:
    """Fills train batches of B = train_batch_groups whole groups of G rows from `generate_fn`.

    generate_fn() -> dict of numpy arrays, leading dim n_prompts*G, including "acc" (bool).
    Every other key (tokens, scores, lengths, ...) is carried through untouched, sliced by whole
    groups. `next_batch()` returns (batch, stats): the batch has leading dim B*G and an added
    bool key "valid" per row; groups carried over from the last call come first (stats
    "dynamic_sampling/groups_carried_in" of them), then this call's in generation order. filter_groups=False is the GRPO baseline: groups are taken as
    they come, all-equal ones included.
    """

    def __init__(self, generate_fn, train_batch_groups: int, group_size: int,
                 max_num_gen_batches: int = 10, *, filter_groups: bool = True,
                 carry_over: bool = False, on_exhausted: str = "mask",
                 metric_keys: tuple = ("acc", "score", "length")):
        if train_batch_groups < 1 or group_size < 1 or max_num_gen_batches < 1:
            raise ValueError("train_batch_groups, group_size and max_num_gen_batches must be >= 1")
        if on_exhausted not in ("mask", "raise"):
            raise ValueError(f"on_exhausted must be 'mask' or 'raise', got {on_exhausted!r}")
        self._generate_fn = generate_fn
        self._B, self._G = train_batch_groups, group_size           # B groups of G responses
        self._max_num_gen_batches = max_num_gen_batches
        self._filter, self._carry_over = filter_groups, carry_over
        self._on_exhausted, self._metric_keys = on_exhausted, metric_keys
        self._carry = {}  # kept groups not yet trained on, rows group-contiguous
        self._keys = None  # the keys of the first generation batch; all must match

    def _num_groups(self, arrays: dict) -> int:
        return len(arrays["acc"]) // self._G if arrays else 0

    def _checked(self, gen: dict) -> dict:
        if "acc" not in gen or "valid" in gen:
            raise ValueError(f"generate_fn must return 'acc' and not 'valid'; got {sorted(gen)}")
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
        while n_kept < self._B and len(generated) < self._max_num_gen_batches:
            gen = self._checked(self._generate_fn())
            acc_PxG = gen["acc"].astype(bool).reshape(-1, self._G)
            keep_P = acc_PxG.any(1) & ~acc_PxG.all(1)  # 0 < sum_i acc_i < G
            if not self._filter:
                keep_P = np.ones_like(keep_P)
            rows = np.repeat(keep_P, self._G)
            pieces.append({k: v[rows] for k, v in gen.items()})
            generated.append(gen)
            kept_masks.append(keep_P)
            n_kept += int(keep_P.sum())
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

"""The host-side records one RL step passes along: sampler -> rewards -> filter -> loop.

Pure numpy; no jax. Field names carry their shape (docs/shapes.md): B rows (responses, a group's
G rows contiguous), Q prompt tokens, N response tokens.

- `GenerationBatch`: one generation batch, sampled and scored (`rollout.sample_and_score`), its
  rewards shaped (`rollout.shape_rewards`);
- `TrainBatch`: what the dynamic-sampling filter hands the loop, B = train_batch_prompts x G
  rows of a `GenerationBatch` plus which of them are real and which were carried over.
"""

from __future__ import annotations

import dataclasses

import numpy as np

TEXT_FIELDS = ("response_B", "pred_B")  # str fields: UTF-8 bytes in a checkpoint


@dataclasses.dataclass(frozen=True)
class GenerationBatch:
    """G sampled responses to each of P prompts, scored: B = P x G rows, row p*G + g."""

    prompt_tokens_BxQ: np.ndarray  # int32, the prompt, left padded
    prompt_mask_BxQ: np.ndarray  # bool, real prompt tokens
    tokens_BxN: np.ndarray  # int32, the response o_i, pad after its end
    mask_BxN: np.ndarray  # bool, response tokens (the end token included)
    logp_BxN: np.ndarray  # float32, log pi_sampler(o_{i,t}), 0 after the end
    length_B: np.ndarray  # int32, |o_i|, the end token included
    truncated_B: np.ndarray  # bool, reached L_max without an end token
    problem_id_B: np.ndarray  # int32, the prompt's problem
    response_B: np.ndarray  # str, the decoded response
    pred_B: np.ndarray  # str, the answer extracted from the response ("" if none)
    score_B: np.ndarray  # float32, the reward function's score
    acc_B: np.ndarray  # bool, the bare correctness (the filter's signal)
    reward_B: np.ndarray  # float32, R_i: score plus the overlong penalty
    loss_keep_B: np.ndarray  # bool, False: the response carries no loss (overlong filter)

    def __post_init__(self):
        rows = {f.name: getattr(self, f.name).shape[:1] for f in dataclasses.fields(self)}
        if len(set(rows.values())) != 1:
            raise ValueError(f"GenerationBatch fields differ in their number of rows: {rows}")

    @property
    def num_rows(self) -> int:
        return len(self.acc_B)

    def rows(self, index) -> GenerationBatch:
        """The rows at `index` (a slice, indices or a bool mask over B), every field alike."""
        return dataclasses.replace(self, **{k: v[index] for k, v in self._fields().items()})

    def with_zero_rows(self, n: int) -> GenerationBatch:
        """These rows, then `n` rows of zeros (False, "") standing in for missing groups."""
        return concat(
            [
                self,
                dataclasses.replace(
                    self, **{k: np.zeros((n,) + v.shape[1:], v.dtype) for k, v in self._fields().items()}
                ),
            ]
        )

    def to_arrays(self) -> dict:
        """Numeric arrays only, for a checkpoint: the text fields as UTF-8 bytes, B x longest."""
        out = self._fields()
        for name in TEXT_FIELDS:
            encoded = np.char.encode(out[name].astype(str), "utf-8")
            width = max(encoded.dtype.itemsize, 1)
            out[name] = np.frombuffer(encoded.astype(f"S{width}").tobytes(), np.uint8).reshape(
                len(encoded), width
            )
        return out

    @classmethod
    def from_arrays(cls, arrays: dict) -> GenerationBatch:
        """The inverse of `to_arrays`."""
        fields = {k: np.asarray(v) for k, v in arrays.items()}
        for name in TEXT_FIELDS:
            utf8_BxW = np.ascontiguousarray(fields[name])
            fields[name] = np.char.decode(
                utf8_BxW.view(f"S{utf8_BxW.shape[1]}").reshape(len(utf8_BxW)), "utf-8"
            )
        return cls(**fields)

    def _fields(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


def concat(batches: list[GenerationBatch]) -> GenerationBatch:
    """The rows of `batches`, one after the other."""
    names = [f.name for f in dataclasses.fields(GenerationBatch)]
    return GenerationBatch(**{k: np.concatenate([getattr(b, k) for b in batches]) for k in names})


@dataclasses.dataclass(frozen=True)
class TrainBatch:
    """One step's train batch: B whole groups of G rows, the carried-over groups first."""

    rows: GenerationBatch
    valid_B: np.ndarray  # bool, False on zero rows standing in for groups the filter missed
    carried_B: np.ndarray  # bool, rows of groups carried over from the step before (sampled
    # under the policy before its last update)

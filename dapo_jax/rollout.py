"""From prompts to scored groups: sample G responses per prompt, decode, score, shape the reward.

`generation_batch` is what the dynamic-sampling filter calls for one generation batch; `evaluate`
runs the same path on held-out problems and reports avg@k / pass@k / maj@k. Only token ids, their
log-probs, lengths and truncation flags come back from the device; text lives on the host.

Shaped reward (spec section 4): R_i = score_i + overlong_penalty(|o_i|), with |o_i| counting the
EOS token; acc_i (the filter's signal) is the bare correctness.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import tqdm

from dapo_jax import data, evaluation, rewards, sharding
from dapo_jax.sampler import Sampler


@dataclasses.dataclass(frozen=True)
class RewardShaping:
    """The overlong rules; lengths in tokens (L_max = the sampler's max_new_tokens)."""

    max_len: int                # L_max
    buffer_len: int             # L_buf
    factor: float               # penalty at L = L_max
    penalty: bool               # soft overlong punishment on
    filter: bool                # overlong filtering: truncated responses carry no loss


def sample_and_score(sampler: Sampler, params, examples: list[dict], group_size: int, rng,
                     tokenizer, scorer: rewards.RewardScorer, prompt_len: int) -> dict:
    """G responses to each of the P examples, scored: numpy arrays of B = P x G rows.

    Keys: prompt_tokens / prompt_mask (BxL, left padded to `prompt_len`), tokens / mask / logp
    (BxN, the completion), length, truncated, score, acc, problem_id, and the lists `pred` and
    `response_text`. The reward fn sees each row's `data_source` and `extra_info` too.
    """
    prompt_PxL, pmask_PxL = data.pad_prompts([ex["prompt_ids"] for ex in examples], (prompt_len,),
                                             sampler.config.pad_id)
    out = sampler.generate(params, prompt_PxL, pmask_PxL, group_size, rng)  # trims to its bucket
    out = {k: sharding.to_host(v) for k, v in out.items()}
    texts = tokenizer.batch_decode([row[:n] for row, n in zip(out["tokens"], out["length"])],
                                   skip_special_tokens=True)
    truths = [ex["ground_truth"] for ex in examples for _ in range(group_size)]
    contexts = [{"data_source": ex["data_source"], "extra_info": ex.get("extra_info")}
                for ex in examples for _ in range(group_size)]
    results, _ = scorer.score_batch(texts, truths, contexts)
    repeat = lambda x: np.repeat(x, group_size, axis=0)
    return {
        "prompt_tokens": repeat(prompt_PxL), "prompt_mask": repeat(pmask_PxL),
        "tokens": out["tokens"], "mask": out["mask"], "logp": out["logp"],
        "length": out["length"].astype(np.int32), "truncated": out["truncated"].astype(bool),
        "score": np.asarray([r["score"] for r in results], np.float32),
        "acc": np.asarray([r["acc"] for r in results], bool),
        "problem_id": repeat(np.asarray([ex["problem_id"] for ex in examples], np.int32)),
        "pred": [r["pred"] for r in results], "response_text": texts,
    }


def generation_batch(sampler, params, examples, group_size, rng, tokenizer, scorer, prompt_len,
                     shaping: RewardShaping) -> dict:
    """One generation batch for the dynamic-sampling filter: `sample_and_score` plus the shaped
    reward R_i and the per-response loss keep flag (False for truncated responses under overlong
    filtering). Every value is a numpy array with a leading dim of B = P x G."""
    batch = sample_and_score(sampler, params, examples, group_size, rng, tokenizer, scorer,
                             prompt_len)
    del batch["pred"], batch["response_text"]
    penalty = rewards.overlong_penalties(batch["length"], shaping.max_len, shaping.buffer_len,
                                         shaping.factor, enabled=shaping.penalty)
    batch["reward"] = (batch["score"] + penalty).astype(np.float32)
    batch["loss_keep"] = rewards.overlong_filter_mask(batch["truncated"], enabled=shaping.filter)
    return batch


def evaluate(sampler, params, examples, samples: int, rng, tokenizer, scorer, prompt_len,
             batch_prompts: int, sample_rows: list | None = None, ks=None) -> dict:
    """avg@n, pass@k and maj@k (k in `ks`, default n alone) over n = `samples` responses per
    held-out problem, with their standard errors, plus mean length.
    Every sample is appended to `sample_rows` when given (prompt, response, extracted answer,
    ground truth, score, acc, length, truncated)."""
    records, lengths = [], []
    chunks = [examples[i:i + batch_prompts] for i in range(0, len(examples), batch_prompts)]
    for i, chunk in enumerate(tqdm.tqdm(chunks, desc="eval", leave=False, disable=None)):
        if len(chunk) < batch_prompts:  # keep one compiled shape: pad with repeats, drop after
            chunk = chunk + [chunk[-1]] * (batch_prompts - len(chunk))
        n_real = len(examples[i * batch_prompts:(i + 1) * batch_prompts]) * samples
        out = sample_and_score(sampler, params, chunk, samples, jax.random.fold_in(rng, i),
                               tokenizer, scorer, prompt_len)
        records += [{"problem_id": int(p), "pred": pred, "acc": bool(a)} for p, pred, a in
                    zip(out["problem_id"][:n_real], out["pred"][:n_real], out["acc"][:n_real])]
        lengths.append(out["length"][:n_real])
        if sample_rows is not None:
            sample_rows += _sample_rows(chunk, samples, out, n_real)
    result = evaluation.evaluate(records, ks=ks or [samples])
    metrics = {f"eval/{k}": v for k, v in result.items() if "@" in k}
    metrics["eval/response_length_mean"] = float(np.concatenate(lengths).mean())
    return metrics


def _sample_rows(examples: list[dict], samples: int, out: dict, n_real: int) -> list[dict]:
    """One readable record per sample of `sample_and_score`'s output (the first n_real rows)."""
    rows = []
    for b in range(n_real):
        example = examples[b // samples]
        rows.append({"problem_id": int(out["problem_id"][b]), "sample": b % samples,
                     "prompt": example["prompt_text"], "response": out["response_text"][b],
                     "pred": out["pred"][b], "ground_truth": example["ground_truth"],
                     "score": float(out["score"][b]), "acc": bool(out["acc"][b]),
                     "length": int(out["length"][b]), "truncated": bool(out["truncated"][b])})
    return rows

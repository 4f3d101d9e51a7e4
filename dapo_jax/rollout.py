"""From prompts to scored groups: sample G responses per prompt, decode, score, shape the reward.

`generation_batch` is one generation batch for the dynamic-sampling filter; `evaluate`
runs the same path on held-out problems and reports avg@k / pass@k / maj@k. Only token ids, their
log-probs, lengths and truncation flags come back from the device; text lives on the host.

Shaped reward (docs/dapo_spec.md section 4): R_i = score_i + overlong_penalty(|o_i|), with |o_i| counting the
EOS token; acc_i (the filter's signal) is the bare correctness.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import tqdm

from dapo_jax import data, evaluation, rewards, sharding
from dapo_jax.records import GenerationBatch
from dapo_jax.sampler import Sampler


@dataclasses.dataclass(frozen=True)
class RewardShaping:
    """The overlong rules, named as their config keys (`reward.*`, `rollout.max_new_tokens`);
    lengths in tokens."""

    max_new_tokens: int  # L_max
    overlong_buffer: int  # L_buf
    overlong_factor: float  # penalty at L = L_max
    overlong_penalty: bool  # soft overlong punishment on
    overlong_filter: bool  # overlong filtering: truncated responses carry no loss

    def __post_init__(self):  # the penalty's own check (0 < L_buf <= L_max), at construction
        rewards.overlong_penalties(
            np.zeros(0), self.max_new_tokens, self.overlong_buffer, self.overlong_factor
        )


def sample_and_score(
    sampler: Sampler,
    params,
    examples: list[dict],
    group_size: int,
    rng,
    *,
    tokenizer,
    scorer: rewards.RewardScorer,
    prompt_len: int,
) -> GenerationBatch:
    """G responses to each of the P examples, decoded and scored: B = P x G rows.

    Prompts are left padded to `prompt_len`; the reward fn sees each row's `data_source` and
    `extra_info` too. The reward is not shaped yet: reward_B is the score and every response
    keeps its loss (`shape_rewards` applies the overlong rules).
    """
    prompt_PxQ, pmask_PxQ = data.pad_prompts(
        [ex["prompt_ids"] for ex in examples], prompt_len, sampler.config.pad_id
    )
    out = sampler.generate(params, prompt_PxQ, pmask_PxQ, group_size, rng)  # trims to its bucket
    out = jax.tree.map(sharding.to_host, out)
    texts = tokenizer.batch_decode(
        [row[:n] for row, n in zip(out.tokens_BxN, out.length_B)], skip_special_tokens=True
    )
    truths = [ex["ground_truth"] for ex in examples for _ in range(group_size)]
    contexts = [
        {"data_source": ex["data_source"], "extra_info": ex.get("extra_info")}
        for ex in examples
        for _ in range(group_size)
    ]
    results, _ = scorer.score_batch(texts, truths, contexts)
    repeat = lambda x: np.repeat(x, group_size, axis=0)
    score_B = np.asarray([r["score"] for r in results], np.float32)
    return GenerationBatch(
        prompt_tokens_BxQ=repeat(prompt_PxQ),
        prompt_mask_BxQ=repeat(pmask_PxQ),
        tokens_BxN=out.tokens_BxN,
        mask_BxN=out.mask_BxN,
        logp_BxN=out.logp_BxN,
        length_B=out.length_B.astype(np.int32),
        truncated_B=out.truncated_B.astype(bool),
        problem_id_B=repeat(np.asarray([ex["problem_id"] for ex in examples], np.int32)),
        response_B=np.asarray(texts, str),
        pred_B=np.asarray([r["pred"] for r in results], str),
        score_B=score_B,
        acc_B=np.asarray([r["acc"] for r in results], bool),
        reward_B=score_B,
        loss_keep_B=np.ones(len(results), bool),
    )


def shape_rewards(batch: GenerationBatch, shaping: RewardShaping) -> GenerationBatch:
    """The batch with the shaped reward R_i = score_i + overlong_penalty(|o_i|) and the
    per-response loss keep flag (False for truncated responses under overlong filtering)."""
    penalty_B = rewards.overlong_penalties(
        batch.length_B,
        shaping.max_new_tokens,
        shaping.overlong_buffer,
        shaping.overlong_factor,
        enabled=shaping.overlong_penalty,
    )
    return dataclasses.replace(
        batch,
        reward_B=(batch.score_B + penalty_B).astype(np.float32),
        loss_keep_B=rewards.overlong_filter_mask(batch.truncated_B, enabled=shaping.overlong_filter),
    )


def generation_batch(
    sampler, params, examples, group_size, rng, *, tokenizer, scorer, prompt_len, shaping: RewardShaping
) -> GenerationBatch:
    """One generation batch for the dynamic-sampling filter: sampled, scored and shaped."""
    scored = sample_and_score(
        sampler, params, examples, group_size, rng, tokenizer=tokenizer, scorer=scorer, prompt_len=prompt_len
    )
    return shape_rewards(scored, shaping)


def evaluate(
    sampler,
    params,
    examples,
    samples: int,
    rng,
    *,
    tokenizer,
    scorer,
    prompt_len,
    batch_prompts: int,
    sample_rows: list | None = None,
    ks=None,
) -> dict:
    """avg@n, pass@k and maj@k (k in `ks`, default n alone) over n = `samples` responses per
    held-out problem, with their standard errors, plus mean length.
    Every sample is appended to `sample_rows` when given (prompt, response, extracted answer,
    ground truth, score, acc, length, truncated).
    Any number of problems and of samples: the problems go in chunks of `batch_prompts` (fewer
    when there are fewer problems), the last one filled up with repeats of its last problem
    (one compiled shape), whose rows are dropped; the sampler fills a chunk up to the mesh
    (`sizes`) the same way."""
    records, lengths = [], []
    size = min(batch_prompts, len(examples))
    chunks = [examples[i : i + size] for i in range(0, len(examples), size)]
    for i, chunk in enumerate(tqdm.tqdm(chunks, desc="eval", leave=False, disable=None)):
        n_real = len(chunk) * samples
        chunk = chunk + [chunk[-1]] * (size - len(chunk))
        rng_i = jax.random.fold_in(rng, i)
        out = sample_and_score(
            sampler, params, chunk, samples, rng_i, tokenizer=tokenizer, scorer=scorer, prompt_len=prompt_len
        )
        records += [
            {"problem_id": int(p), "pred": str(pred), "acc": bool(a)}
            for p, pred, a in zip(out.problem_id_B[:n_real], out.pred_B[:n_real], out.acc_B[:n_real])
        ]
        lengths.append(out.length_B[:n_real])
        if sample_rows is not None:
            examples_B = [chunk[b // samples] for b in range(n_real)]
            records_B = sample_records(out, examples_B, range(n_real))
            sample_rows += [{"sample": b % samples, **r} for b, r in enumerate(records_B)]
    result = evaluation.evaluate(records, ks=ks or [samples])
    metrics = {f"eval/{k}": v for k, v in result.items() if "@" in k}
    metrics["eval/response_length_mean"] = float(np.concatenate(lengths).mean())
    return metrics


def sample_records(
    batch: GenerationBatch, examples: list[dict], rows, tail_chars: int | None = None
) -> list[dict]:
    """One readable record per row b of `rows` (`examples[i]` the problem of row rows[i]): prompt,
    response (their last `tail_chars` characters, all at None), extracted answer, ground truth, score,
    acc, shaped reward, length, truncated."""
    tail = (lambda text: text[-tail_chars:]) if tail_chars else (lambda text: text)
    return [
        {
            "problem_id": int(batch.problem_id_B[b]),
            "prompt": tail(example["prompt_text"]),
            "response": tail(str(batch.response_B[b])),
            "pred": str(batch.pred_B[b]),
            "ground_truth": example["ground_truth"],
            "score": float(batch.score_B[b]),
            "acc": bool(batch.acc_B[b]),
            "reward": float(batch.reward_B[b]),
            "length": int(batch.length_B[b]),
            "truncated": bool(batch.truncated_B[b]),
        }
        for b, example in zip(rows, examples)
    ]

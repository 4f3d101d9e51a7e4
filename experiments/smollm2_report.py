"""The SmolLM2 run's report: held-out accuracy before and after with its paired standard error,
format compliance, the curves and a completions table, from `dapo_jax.evaluate` outputs.

    python -m dapo_jax.evaluate --config=configs/dapo.py:smollm2_135m \
        --model=models/smollm2-135m-instruct --out=runs/smollm2/eval_base
    python -m dapo_jax.evaluate --config=configs/dapo.py:smollm2_135m --workdir=runs/smollm2 \
        --out=runs/smollm2/eval_final
    python experiments/smollm2_report.py --before=runs/smollm2/eval_base \
        --after=runs/smollm2/eval_final --run=runs/smollm2 --out=experiments/results/smollm2

writes `summary.json` (avg@n before and after, each ± its standard error over problems, the
paired gain ± its standard error: the mean and SE over problems of the difference of each
problem's accuracy, and the gain in SEs; compliance: the fraction of responses holding a number
the scorer reads, and holding an "Answer:" line), `completions.md` (the first sample of the first
problems, before and after: what the model wrote, what was read from it, how it scored),
the run's `metrics.jsonl` and its curves (`dapo_jax.plot`); with --run, the step's split into
rollout and update against this machine's roofline, measured in the same call (`roofline`:
the best f32 GEMM rate at the model's shapes through XLA:CPU, and a streaming read's bandwidth).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import time

import numpy as np

from dapo_jax import hf_model_config, math_answers, plot


def load_samples(eval_dir: str) -> list[dict]:
    """The rows of `eval_dir`/samples.jsonl (one per sampled response)."""
    with open(os.path.join(eval_dir, "samples.jsonl")) as f:
        return [json.loads(line) for line in f]


def per_problem_accuracy(rows: list[dict]) -> dict[int, float]:
    """{problem_id: mean acc over its samples}."""
    by_problem = {}
    for r in rows:
        by_problem.setdefault(r["problem_id"], []).append(float(r["acc"]))
    return {p: float(np.mean(a)) for p, a in by_problem.items()}


def mean_and_se(values) -> tuple[float, float]:
    """(mean, standard error of the mean) of per-problem values."""
    v = np.asarray(list(values), np.float64)
    return float(v.mean()), float(v.std(ddof=1) / np.sqrt(len(v))) if len(v) > 1 else float("nan")


def paired_gain(before: dict[int, float], after: dict[int, float]) -> tuple[float, float]:
    """(mean, SE) over the problems both evaluated of after - before accuracy."""
    common = sorted(set(before) & set(after))
    if not common:
        raise ValueError("the two evaluations share no problem")
    return mean_and_se(after[p] - before[p] for p in common)


def compliance(rows: list[dict]) -> dict[str, float]:
    """Fractions of responses the scorer reads a prediction from, and holding an "Answer:" line."""
    return {
        "readable": float(np.mean([r["pred"] != math_answers.INVALID for r in rows])),
        "answer_line": float(
            np.mean([math_answers.extract_answer(r["response"]) != math_answers.INVALID for r in rows])
        ),
        "truncated": float(np.mean([bool(r["truncated"]) for r in rows])),
        "mean_length": float(np.mean([r["length"] for r in rows])),
    }


def summary(before_rows: list[dict], after_rows: list[dict]) -> dict:
    """The report's figures (module docstring)."""
    before, after = per_problem_accuracy(before_rows), per_problem_accuracy(after_rows)
    gain, gain_se = paired_gain(before, after)
    out = {"problems": len(set(before) & set(after))}
    for name, acc, rows in (("before", before, before_rows), ("after", after, after_rows)):
        mean, se = mean_and_se(acc.values())
        out[name] = {"avg": mean, "se": se, "samples_per_problem": len(rows) / len(acc), **compliance(rows)}
    out["gain"], out["gain_se"] = gain, gain_se
    out["gain_in_se"] = gain / gain_se if gain_se > 0 else float("inf")
    return out


def step_split(records: list[dict], params: int, gen_prompts: int, group: int, prompt_tokens: int) -> dict:
    """Median seconds of a step's rollout and update over the steps after the first (which
    compiles), and the FLOP rates they reach: the rollout's 2N per token, N = `params`, over
    the prompts' prefill (gen_batches x `gen_prompts` x `prompt_tokens`, one per group) and the
    tokens decoded (gen_batches x `gen_prompts` x G x the mean length before the filter); the
    update's 6N per trained token (rows' prompt and response tokens; log pi_old is the
    sampler's, so no extra forward pass)."""
    steps = [r for r in records if r["step"] > 1 and "timing/rollout_s" in r]
    if not steps:
        raise ValueError("no step after the first has timings")
    med = lambda xs: float(statistics.median(xs))
    rollout_flops = [
        2
        * params
        * r["dynamic_sampling/gen_batches"]
        * gen_prompts
        * (prompt_tokens + group * r["before_filter/length_mean"])
        for r in steps
    ]
    update_flops = [6 * params * r["throughput/train_tokens_per_s"] * r["timing/train_s"] for r in steps]
    return {
        "steps": len(steps) + 1,
        "step_s": med([r["timing/step_s"] for r in steps]),
        "rollout_s": med([r["timing/rollout_s"] for r in steps]),
        "update_s": med([r["timing/train_s"] for r in steps]),
        "rollout_gflops": med([f / r["timing/rollout_s"] / 1e9 for f, r in zip(rollout_flops, steps)]),
        "update_gflops": med([f / r["timing/train_s"] / 1e9 for f, r in zip(update_flops, steps)]),
    }


def roofline(hidden: int, mlp: int, vocab: int, reps: int = 5) -> dict:
    """This machine through XLA:CPU: the best f32 GEMM rate (GFLOP/s) at the MLP's
    [2048, D] x [D, F] and the LM head's [512, D] x [D, V], and a streaming sum's GB/s."""
    import jax  # noqa: PLC0415 - the report's other figures need no jax
    import jax.numpy as jnp  # noqa: PLC0415

    def best(fn, *args) -> float:
        jax.block_until_ready(fn(*args))
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times.append(time.perf_counter() - t)
        return min(times)

    dot = jax.jit(jnp.dot)
    out = {}
    for name, (m, k, n) in {"gemm_mlp": (2048, hidden, mlp), "gemm_lm_head": (512, hidden, vocab)}.items():
        a, b = jnp.ones((m, k), jnp.float32), jnp.ones((k, n), jnp.float32)
        out[f"{name}_gflops"] = 2 * m * k * n / best(dot, a, b) / 1e9
    x = jnp.ones((64 * 2**20,), jnp.float32)  # 256 MiB
    out["stream_gbs"] = x.nbytes / best(jax.jit(jnp.sum), x) / 1e9
    return out


def _cell(text: str, limit: int = 300) -> str:
    """`text` as one markdown table cell: pipes escaped, newlines as <br>, cut to `limit` chars."""
    text = text if len(text) <= limit else text[:limit] + " ..."
    return text.replace("|", "\\|").replace("\n", "<br>")


def _problem(prompt: str) -> str:
    """The user's message of a ChatML prompt (the whole prompt when it is not one)."""
    user = prompt.rsplit("<|im_start|>user\n", 1)[-1]
    return user.split("<|im_end|>", 1)[0]


def completions_table(before_rows: list[dict], after_rows: list[dict], k: int = 20) -> str:
    """Markdown: the first sample of the first `k` problems, before and after."""
    first = lambda rows: {r["problem_id"]: r for r in rows if r["sample"] == 0}
    before, after = first(before_rows), first(after_rows)
    lines = [
        "| problem | truth | before: response | read | ok | after: response | read | ok |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for p in sorted(set(before) & set(after))[:k]:
        b, a = before[p], after[p]
        mark = lambda r: "✓" if r["acc"] else "✗"
        lines.append(
            f"| {_cell(_problem(b['prompt']))} | {b['ground_truth']} | {_cell(b['response'])} | {b['pred']} "
            f"| {mark(b)} | {_cell(a['response'])} | {a['pred']} | {mark(a)} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--before", required=True, help="evaluate's --out of the base model")
    parser.add_argument("--after", required=True, help="evaluate's --out of the trained model")
    parser.add_argument("--run", default=None, help="the run's workdir (metrics.jsonl, curves)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--rows", type=int, default=20, help="problems in completions.md")
    parser.add_argument("--config", default="smollm2_135m", help="with --run: its configs/dapo.py variant")
    args = parser.parse_args(argv)
    before, after = load_samples(args.before), load_samples(args.after)
    os.makedirs(args.out, exist_ok=True)
    result = summary(before, after)
    with open(os.path.join(args.out, "completions.md"), "w") as f:
        f.write(completions_table(before, after, args.rows))
    if args.run:
        shutil.copy(os.path.join(args.run, "metrics.jsonl"), os.path.join(args.out, "metrics.jsonl"))
        plot.plot_runs([args.run], args.out)
        result["speed"] = _speed(args.run, args.config)
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(result, f, indent=2)
    b, a = result["before"], result["after"]
    print(
        f"{result['problems']} problems: avg {b['avg']:.3f} ± {b['se']:.3f} -> "
        f"{a['avg']:.3f} ± {a['se']:.3f}, "
        f"gain {result['gain']:+.3f} ± {result['gain_se']:.3f} ({result['gain_in_se']:.1f} SE); "
        f"readable {b['readable']:.2f} -> {a['readable']:.2f}"
    )


def _speed(run: str, variant: str) -> dict:
    """`step_split` of the run's metrics with the config's sizes, beside `roofline`."""
    from configs import dapo  # noqa: PLC0415 - run from the repository root

    c = dapo.get_config(variant)
    cfg = hf_model_config.config_from_hf(hf_model_config.read_hf_config(c.model.path))
    with open(os.path.join(run, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    split = step_split(
        records, cfg.num_params(), c.filter.gen_batch_prompts, c.rollout.group_size, c.data.max_prompt_len
    )
    return {**split, **roofline(cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size)}


if __name__ == "__main__":
    main()

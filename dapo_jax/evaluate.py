"""Held-out evaluation of a checkpoint or a Hugging Face model, without training:

    python -m dapo_jax.evaluate --config=configs/dapo.py:tiny --workdir=runs/tiny [--step=20]
    python -m dapo_jax.evaluate --config=configs/dapo.py:qwen2_5_7b --model=Qwen/Qwen2.5-7B \
        --data=/data/aime-2024.parquet --samples=32 --temperature=1 --top_p=0.7 --out=DIR

The config gives the template, prompt length, reward fn and batch size; the flags override its
`eval.samples`, `eval.temperature`, `eval.top_p`, `rollout.max_new_tokens` and
`data.eval_files` (a file or a Hub dataset). The policy is checkpoint `--step` of `--workdir`
(default the newest) or the model folder / Hub id `--model`. The sampling and scoring are the
training run's evaluation (`train.evaluate`, the same seed per step); prints avg@n, pass@k and
maj@k (k = 1, 2, 4, ..., n) each ± its standard error over problems, and writes to `--out`
(default `<workdir>/eval_step_<N>`) `metrics.json` and `samples.jsonl`, one line per sample:
problem_id, sample, prompt, response, pred (the extracted answer), ground_truth, score, acc,
length (tokens, EOS included), truncated. On a pod slice, run it on every host with `--multihost`
(as train): the processes sample together, each scores 1/n of the responses, and process 0
writes the files.
"""

from __future__ import annotations

import copy
import json
import os

import jax
from absl import flags

from dapo_jax import cli, evaluation, export, hf_io, hub, paths, train
from dapo_jax.config_checks import check_config
from dapo_jax.errors import ConfigError, one_line_errors
from dapo_jax.run import build


def apply_overrides(c, *, data=None, samples=None, temperature=None, top_p=None, max_new_tokens=None):
    """`c` with the command's sampling and data flags in place of the config's values."""
    c = copy.deepcopy(c)  # keeps each key's schema (config_schema.Field)
    if data:
        c.data.eval_files = tuple(data)
    for key, value in (("samples", samples), ("temperature", temperature), ("top_p", top_p)):
        if value is not None:
            c.eval[key] = value
    if max_new_tokens is not None:
        c.rollout.max_new_tokens = max_new_tokens
        c.reward.overlong_buffer = min(c.reward.overlong_buffer, max_new_tokens)  # unused here
    return c


def evaluate(
    c,
    *,
    workdir: str | None = None,
    step: int | None = None,
    model: str | None = None,
    out: str | None = None,
) -> tuple[dict, str]:
    """Evaluates checkpoint `step` of `workdir`, or the model folder / Hub id `model`, on the
    config's eval files; writes `out`/metrics.json and `out`/samples.jsonl. Returns (metrics,
    out)."""
    if (workdir is None) == (model is None):
        raise ConfigError(
            "give one of --workdir (a run's checkpoint) and --model (a Hugging Face model folder or Hub id)"
        )
    if model is not None:
        if out is None:
            raise ConfigError("--model needs --out, the folder for metrics.json and samples.jsonl")
        c = export.without_train_data(c)
        c.model.path = model
        c = hub.resolve_config(c)
        check_config(c)
        run, step = build(c, out), 0
        params = hf_io.load_params(c.model.path, run.model, run.mesh)
    else:
        run, state, step = export.restore(c, workdir, step)
        params = state.params
        out = out or os.path.join(workdir, f"eval_step_{step}")
    if not run.eval_examples:
        run.scorer.close()
        raise ConfigError("no evaluation problems: set --data or the config's data.eval_files")
    rows = []
    try:
        result = train.evaluate(run, params, step, rows, ks=evaluation.default_ks(run.config.eval.samples))
    finally:
        run.scorer.close()
    result["eval/num_problems"] = len(run.eval_examples)
    if jax.process_index() != 0:  # every process holds the same samples and metrics
        return result, out
    folder = paths.run_path(out)  # local, or gs:// (a pod's workdir) through the path layer
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "samples.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (folder / "metrics.json").write_text(json.dumps({"step": step, **result}, indent=2))
    return result, out


def _define_flags():
    """This command's flags beside train's --config (with overrides) and --workdir."""
    flags.DEFINE_integer("step", None, "with --workdir: the checkpoint step (default: newest)")
    flags.DEFINE_string("model", None, "a Hugging Face model folder or Hub id, not a workdir")
    flags.DEFINE_list("data", None, "eval data files or Hub datasets (default: data.eval_files)")
    flags.DEFINE_integer("samples", None, "responses per problem, n (default: eval.samples)")
    flags.DEFINE_float("temperature", None, "sampling temperature (default: eval.temperature)")
    flags.DEFINE_float("top_p", None, "nucleus sampling (default: eval.top_p)")
    flags.DEFINE_integer("max_new_tokens", None, "response length bound (default: the config's)")
    flags.DEFINE_string("out", None, "output folder (default: <workdir>/eval_step_<N>)")


def main(argv):
    cli.start(argv, "config")
    f = flags.FLAGS
    with one_line_errors():
        c = apply_overrides(
            f.config,
            data=f.data,
            samples=f.samples,
            temperature=f.temperature,
            top_p=f.top_p,
            max_new_tokens=f.max_new_tokens,
        )
        result, out = evaluate(c, workdir=f.workdir, step=f.step, model=f.model, out=f.out)
    if jax.process_index() != 0:
        return
    summary = evaluation.summary_text(result)
    print(f"{result['eval/num_problems']} problems x {c.eval.samples} samples: {summary}")
    print(f"samples and metrics: {out}")


if __name__ == "__main__":
    _define_flags()
    cli.run(main)

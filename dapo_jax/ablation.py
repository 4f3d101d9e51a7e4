"""The DAPO paper's ablation table (docs/dapo_spec.md section 9), run and reported with one command each:

    python -m dapo_jax.ablation run --scale=tiny --seeds=3 --workdir=runs/ablation
    python -m dapo_jax.ablation report runs/ablation --out=experiments/results/ablation_tiny

`run` trains every row of `configs/ablation.py` (naive GRPO, + overlong filtering, + Clip-Higher,
+ soft overlong punishment, + token-level loss, + dynamic sampling = DAPO) for each seed, one seed
after the other so that a partial study already has whole tables, each run in
WORKDIR/ROW/seedS; then the SFT control (WORKDIR/sft_control/seedS, `sft_control`). A finished
run is skipped and an interrupted one resumes (`dapo_jax.train` does both). `--quick` shrinks
every run to the file's QUICK overrides (a test checks the table and the figures that way).
The config file (`--config_file`, configs/ablation.py) defines ROW_NAMES, get_config,
PAPER_AIME24, QUICK and SFT.

On TPU slices, `--scale=qwen2_5_32b` is the same study: one row a slice, e.g. `--rows=clip_higher
--seeds=0` on each slice with one shared `gs://` workdir, then `report` on any machine that sees it.

`report` writes `table.md` and the figures into its --out directory (`ablation_report`).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
import ml_collections
import numpy as np
import optax

from dapo_jax import hf_io, metrics, overrides, sft, train, train_step
from dapo_jax.run import build, load_config_file

SFT_CONTROL = "sft_control"
STUDY_FILE = "study.json"  # what `run` was asked for; `report` reads it


def row_config(module, row: str, scale: str, seed: int, quick: bool) -> ml_collections.ConfigDict:
    """One run's config: the row at the scale, with the seed (and the QUICK overrides)."""
    c = module.get_config(f"{row},{scale}")
    c.seed = seed
    return overrides.apply(c, module.QUICK) if quick else c


def run_dir(workdir: str, row: str, seed: int) -> str:
    return os.path.join(workdir, row, f"seed{seed}")


def run_study(
    config_file: str,
    scale: str,
    seeds: list[int],
    workdir: str,
    rows: list[str] | None = None,
    quick: bool = False,
    sft_control_runs: bool = True,
) -> None:
    """Every (seed, row) run in turn, then the SFT control of each seed (module docstring)."""
    module = load_config_file(config_file)
    rows = list(rows or module.ROW_NAMES)
    unknown = [r for r in rows if r not in module.ROW_NAMES]
    if unknown:
        raise ValueError(f"unknown ablation rows {unknown}; choose from {module.ROW_NAMES}")
    os.makedirs(workdir, exist_ok=True)
    study = {
        "config_file": config_file,
        "scale": scale,
        "seeds": seeds,
        "rows": rows,
        "quick": quick,
        "sft_control": sft_control_runs,
    }
    with open(os.path.join(workdir, STUDY_FILE), "w") as f:
        json.dump(study, f, indent=1)
    for seed in seeds:
        for row in rows:
            c = row_config(module, row, scale, seed, quick)
            if _finished(run_dir(workdir, row, seed), c.train.steps):
                continue
            print(f"=== {row}, seed {seed}", flush=True)
            train.train(c, run_dir(workdir, row, seed))
        if sft_control_runs:
            c = row_config(module, module.ROW_NAMES[-1], scale, seed, quick)
            sft_control(c, run_dir(workdir, SFT_CONTROL, seed), lr=module.SFT["lr"])


def _sft_updates(run, c: ml_collections.ConfigDict, examples: list[dict], params, lr: float):
    """`sft_control`'s updates from `params`: (params, {sft/loss of the last 10, sft/updates})."""
    updates = c.train.steps * (c.train.train_batch_prompts // c.train.mini_batch_prompts)
    rows = c.train.mini_batch_prompts * c.rollout.group_size
    o = c.optim
    optimizer = train_step.make_optimizer(
        optax.constant_schedule(lr),
        weight_decay=o.weight_decay,
        grad_clip=o.grad_clip,
        b1=o.b1,
        b2=o.b2,
        eps=o.eps,
    )
    opt_state = optimizer.init(params)
    solution_ids = run.tokenizer([ex["solution"] for ex in examples], add_special_tokens=False)["input_ids"]
    seq_len = c.data.max_prompt_len + c.rollout.max_new_tokens
    step = sft.make_sft_step(run.model, optimizer)
    rng = np.random.default_rng(c.seed)
    losses = []
    for _ in range(updates):
        chosen = rng.integers(0, len(examples), rows)
        arrays = sft.sft_batch(
            [examples[i]["prompt_ids"] for i in chosen],
            [solution_ids[i] for i in chosen],
            run.tokenizer.eos_token_id,
            run.tokenizer.pad_token_id,
            seq_len,
        )
        params, opt_state, loss = step(params, opt_state, *arrays)
        losses.append(loss)
    return params, {"sft/loss": float(np.mean(jax.device_get(losses[-10:]))), "sft/updates": updates}


def sft_control(c: ml_collections.ConfigDict, workdir: str, *, lr: float) -> dict:
    """Continued SFT from the base model on the DAPO run's training budget: as many AdamW
    updates (steps x train_batch / mini_batch) of as many sequences (mini_batch_prompts x G),
    drawn from the training prompts' worked solutions (`extra_info.solution`), DAPO's optimizer
    settings at a constant learning rate `lr`. Held-out accuracy before and after, measured as
    the RL runs measure it, goes to the workdir's metrics.jsonl. Skipped when finished, rerun
    from scratch when interrupted (it is the cheapest run). Returns the last record.
    """
    done = run_records(workdir)
    if done and done[-1].get("sft/finished"):
        return done[-1]
    print(f"=== {SFT_CONTROL}: {workdir}", flush=True)
    run = build(c, workdir)
    try:
        examples = [ex for ex in run.train_examples if ex["solution"]]
        if not examples:
            raise ValueError(
                "the SFT control needs worked solutions (extra_info.solution) in "
                "the training data; these files have none"
            )
        params = hf_io.load_params(c.model.path, run.model, run.mesh)
        writer = metrics.MetricsWriter(workdir)
        writer.write(0, train.evaluate(run, params, 0))
        t0 = time.time()
        params, last = _sft_updates(run, c, examples, params, lr)
        last["timing/train_s"] = time.time() - t0
        last.update(train.evaluate(run, params, c.train.steps))
        last["sft/finished"] = 1
        writer.write(c.train.steps, last)
        writer.close()
        return last
    finally:
        run.scorer.close()


def _finished(workdir: str, steps: int) -> bool:
    """Whether the run in `workdir` has logged its last step (and exported its model)."""
    records = run_records(workdir)
    return bool(records) and records[-1]["step"] >= steps and os.path.isdir(os.path.join(workdir, "export"))


def run_records(workdir: str) -> list[dict]:
    """The metrics records a run in `workdir` logged so far."""
    path = os.path.join(workdir, metrics.JSONL)
    return metrics.read_jsonl(path) if os.path.isfile(path) else []


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    run_p = commands.add_parser("run", help="train every row for every seed (resumable)")
    run_p.add_argument("--config_file", default="configs/ablation.py")
    run_p.add_argument("--scale", default="tiny", help="a variant of configs/dapo.py")
    run_p.add_argument("--seeds", type=int, default=3, help="seeds 0 .. N-1")
    run_p.add_argument("--seed_list", default=None, help="explicit seeds, e.g. 3,4 (overrides --seeds)")
    run_p.add_argument("--rows", default=None, help="comma-separated rows (default: all)")
    run_p.add_argument("--workdir", required=True)
    run_p.add_argument("--quick", action="store_true", help="the file's QUICK overrides")
    run_p.add_argument("--no_sft_control", action="store_true")
    report_p = commands.add_parser("report", help="the table and figures of a study")
    report_p.add_argument("workdir")
    report_p.add_argument("--out", default=None, help="default: WORKDIR/report")
    args = parser.parse_args(argv)
    if args.command == "run":
        seeds = [int(s) for s in args.seed_list.split(",")] if args.seed_list else list(range(args.seeds))
        run_study(
            args.config_file,
            args.scale,
            seeds,
            args.workdir,
            args.rows.split(",") if args.rows else None,
            args.quick,
            not args.no_sft_control,
        )
    else:
        from dapo_jax import ablation_report  # noqa: PLC0415 - it reads this module's layout

        print(ablation_report.write_report(args.workdir, args.out or os.path.join(args.workdir, "report")))


if __name__ == "__main__":
    main()

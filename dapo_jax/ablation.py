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

`report` writes `table.md` (held-out avg@k per row: mean and spread over seeds, the paper's AIME
2024 numbers beside it, the responses each row generated, its clip fractions, entropy,
truncation, and the steps and samples it took to reach a common accuracy) and the figures of
`FIGURES` into its --out directory.
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
        max_grad_norm=o.grad_clip,
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
    done = _records(workdir)
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
    records = _records(workdir)
    return bool(records) and records[-1]["step"] >= steps and os.path.isdir(os.path.join(workdir, "export"))


def _records(workdir: str) -> list[dict]:
    path = os.path.join(workdir, metrics.JSONL)
    return metrics.read_jsonl(path) if os.path.isfile(path) else []


# ----------------------------------------------------------------------------- the report


def _avg_key(records: list[dict]) -> str | None:
    return next((k for r in records for k in r if k.startswith("eval/avg@")), None)


def _curve(records: list[dict], key: str) -> tuple[np.ndarray, np.ndarray]:
    pts = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float))]
    return (np.array([p[0] for p in pts]), np.array([p[1] for p in pts], float))


def _generated(records: list[dict], group_size: int) -> np.ndarray:
    """Responses generated up to and including each record's step (prompts consumed x G)."""
    return np.cumsum(
        [r.get("dynamic_sampling/prompts_consumed", 0) * group_size for r in records], dtype=np.int64
    )


def run_summary(records: list[dict], group_size: int) -> dict:
    """One run's row of figures: held-out accuracy before and after, responses generated, the
    mean clip fractions, entropy over the last quarter of steps, the truncated fraction of all
    generated responses, and the (step, responses generated) of every evaluation."""
    key = _avg_key(records)
    evals = [r for r in records if key and key in r]
    steps = [r for r in records if "before_filter/acc_mean" in r]
    mean = lambda k, rs: (
        float(np.mean([r[k] for r in rs if k in r])) if any(k in r for r in rs) else float("nan")
    )
    generated = _generated(records, group_size)
    last_quarter = steps[len(steps) - max(len(steps) // 4, 1) :]
    return {
        "before": evals[0][key] if evals else float("nan"),
        "after": evals[-1][key] if evals else float("nan"),
        "generated": int(generated[-1]) if len(generated) else 0,
        "clip_upper": mean("actor/pg_clipfrac_upper", steps),
        "clip_lower": mean("actor/pg_clipfrac_lower", steps),
        "clip_dual": mean("actor/pg_clipfrac_dual", steps),
        "entropy": mean("actor/entropy", last_quarter),
        "truncated": mean("before_filter/truncated_mean", steps),
        "length": mean("before_filter/length_mean", last_quarter),
        "evals": [(r["step"], r[key], int(g)) for r, g in zip(records, generated) if key and key in r],
    }


def _first_reaching(evals: list, threshold: float):
    """(step, responses generated) of the first evaluation at or above `threshold`, or None."""
    return next(((step, gen) for step, acc, gen in evals if acc >= threshold), None)


def _fmt(values: list[float], digits: int = 3) -> str:
    values = [v for v in values if np.isfinite(v)]
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return (
        f"{np.mean(values):.{digits}f} ± {np.std(values, ddof=1):.{digits}f} "
        f"[{min(values):.{digits}f}, {max(values):.{digits}f}]"
    )


def write_report(workdir: str, out_dir: str) -> str:
    """table.md and the figures of the study in `workdir`; returns the table's path."""
    with open(os.path.join(workdir, STUDY_FILE)) as f:
        study = json.load(f)
    module = load_config_file(study["config_file"])
    rows = list(module.ROW_NAMES)  # rows the study did not run are listed as such
    names = rows + ([SFT_CONTROL] if study["sft_control"] else [])
    group_size = row_config(module, rows[-1], study["scale"], 0, study["quick"]).rollout.group_size
    runs = {name: {s: _records(run_dir(workdir, name, s)) for s in study["seeds"]} for name in names}
    summaries = {
        name: [run_summary(r, group_size) for r in by_seed.values() if r] for name, by_seed in runs.items()
    }
    os.makedirs(out_dir, exist_ok=True)
    base = [s["before"] for ss in summaries.values() for s in ss]
    dapo_after = [s["after"] for s in summaries.get(rows[-1], [])]
    threshold = (np.nanmean(base) + np.nanmean(dapo_after)) / 2 if base and dapo_after else None
    lines = [
        f"# Ablation study: scale `{study['scale']}`, seeds {study['seeds']}"
        + (" (quick)" if study["quick"] else ""),
        "",
        f"Command: `python -m dapo_jax.ablation run --scale={study['scale']} "
        f"--seeds={len(study['seeds'])} --workdir={workdir}`" + (" --quick" if study["quick"] else ""),
        "",
        "Held-out accuracy: mean ± std over seeds [min, max]. Base model before training: "
        f"{_fmt(base)}. Clip fractions are token means over every update; entropy and length over"
        " the last quarter of steps; truncated: the fraction of all generated responses."
        + (
            f" Steps (responses generated) to reach {threshold:.3f}, halfway from the base to the "
            "last row's final accuracy: first evaluation at or above it, per seed."
            if threshold is not None
            else ""
        ),
        "",
        "| row | paper AIME24 | held-out after | gain | responses generated | clip+ | clip- "
        "| dual | entropy | length | truncated | steps (responses) to threshold |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [
        _table_row(name, summaries[name], module.PAPER_AIME24.get(name, "-"), threshold) for name in names
    ]
    table = os.path.join(out_dir, "table.md")
    with open(table, "w") as f:
        f.write("\n".join(lines) + "\n")
    for figure in FIGURES:
        _plot(figure, runs, group_size, out_dir)
    return table


def _table_row(name: str, ss: list[dict], paper, threshold: float | None) -> str:
    """The table line of row `name` from its per-seed summaries `ss` (paper: its AIME24 figure)."""
    if not ss:
        return f"| {name} | {paper} | not run |" + " |" * 9
    reach = [_first_reaching(s["evals"], threshold) for s in ss] if threshold else []
    cells = [
        name,
        str(paper),
        _fmt([s["after"] for s in ss]),
        _fmt([s["after"] - s["before"] for s in ss]),
        f"{np.mean([s['generated'] for s in ss]):,.0f}",
        *(_fmt([s[k] for s in ss], 4) for k in ("clip_upper", "clip_lower", "clip_dual", "entropy")),
        _fmt([s["length"] for s in ss], 1),
        _fmt([s["truncated"] for s in ss], 4),
        ", ".join("never" if r is None else f"{r[0]} ({r[1]:,})" for r in reach) or "-",
    ]
    return "| " + " | ".join(cells) + " |"


# (file, title, [(panel title, metric key, x axis: "step" or "generated")], rows compared)
FIGURES = (
    (
        "clip_higher.png",
        "Clip-Higher: entropy and the upper clip fraction",
        [
            ("entropy (nats/token)", "actor/entropy", "step"),
            ("upper clip fraction", "actor/pg_clipfrac_upper", "step"),
        ],
        ("overlong_filter", "clip_higher"),
    ),
    (
        "token_level_loss.png",
        "Token-level loss: response length and entropy",
        [
            ("mean response length", "before_filter/length_mean", "step"),
            ("entropy (nats/token)", "actor/entropy", "step"),
        ],
        ("soft_overlong", "token_level_loss"),
    ),
    (
        "dynamic_sampling.png",
        "Dynamic sampling: held-out accuracy against steps and samples",
        [("held-out accuracy", "eval/avg@", "step"), ("held-out accuracy", "eval/avg@", "generated")],
        ("token_level_loss", "dynamic_sampling"),
    ),
    (
        "dapo_dynamics.png",
        "DAPO: length, reward, entropy and mean probability",
        [
            ("mean response length", "before_filter/length_mean", "step"),
            ("mean reward", "data/reward_mean", "step"),
            ("entropy (nats/token)", "actor/entropy", "step"),
            ("mean token probability", "actor/token_prob", "step"),
        ],
        ("dynamic_sampling",),
    ),
)


def _plot(figure, runs: dict, group_size: int, out_dir: str) -> None:
    """One figure: each panel a metric of the compared rows, the mean over seeds and its range."""
    import matplotlib  # noqa: PLC0415 - plotting is the report's business only

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    name, title, panels, rows = figure
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 3.4), squeeze=False)
    for ax, (panel_title, key, x_axis) in zip(axes[0], panels):
        for row in rows:
            curves = []
            for records in runs.get(row, {}).values():
                if not records:
                    continue
                k = _avg_key(records) if key.endswith("@") else key
                steps, values = _curve(records, k) if k else (np.zeros(0), np.zeros(0))
                if x_axis == "generated":
                    generated = dict(zip([r["step"] for r in records], _generated(records, group_size)))
                    steps = np.array([generated[s] for s in steps])
                curves.append((steps, values))
            if not curves:
                continue
            n = min(len(v) for _, v in curves)
            x = np.mean([s[:n] for s, _ in curves], axis=0)
            ys = np.array([v[:n] for _, v in curves])
            ax.plot(x, ys.mean(0), marker=".", label=f"{row} (n={len(curves)})")
            ax.fill_between(x, ys.min(0), ys.max(0), alpha=0.2)
        ax.set_title(panel_title, fontsize=9)
        ax.set_xlabel("responses generated" if x_axis == "generated" else "step")
        if ax.lines:
            ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, name), dpi=90)
    plt.close(fig)


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
        print(write_report(args.workdir, args.out or os.path.join(args.workdir, "report")))


if __name__ == "__main__":
    main()

"""The ablation study's report (`python -m dapo_jax.ablation report WORKDIR`): `table.md` (held-out
avg@k per row: mean and spread over seeds, the paper's AIME 2024 numbers beside it, the responses
each row generated, its clip fractions, entropy, truncation, and the steps and samples it took to
reach a common accuracy) and the figures of `FIGURES`, from the runs `ablation.run_study` wrote.
"""

from __future__ import annotations

import json
import os

import numpy as np

from dapo_jax.ablation import SFT_CONTROL, STUDY_FILE, row_config, run_dir, run_records
from dapo_jax.run import load_config_file


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
    runs = {name: {s: run_records(run_dir(workdir, name, s)) for s in study["seeds"]} for name in names}
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

"""Curves of one or several runs: `python -m dapo_jax.plot WORKDIR [WORKDIR ...] --out DIR`.

Reads each workdir's metrics.jsonl and writes one PNG per panel (accuracy / reward, entropy, mean
response length, mean token probability, the upper and lower clip fractions, the fraction of groups
dynamic sampling kept, and the held-out accuracy when evaluated), runs overlaid
for comparison, plus `curves.png` with every panel.
"""

from __future__ import annotations

import argparse

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from dapo_jax import paths  # noqa: E402
from dapo_jax.metrics import JSONL, read_jsonl  # noqa: E402

PANELS = (
    ("acc", ("before_filter/acc_mean", "before_filter/score_mean"), "train accuracy / score"),
    ("entropy", ("actor/entropy",), "entropy (nats/token)"),
    ("length", ("before_filter/length_mean",), "mean response length (tokens)"),
    ("token_prob", ("actor/token_prob",), "mean token probability"),
    ("clip", ("actor/pg_clipfrac_upper", "actor/pg_clipfrac_lower"), "clipped token fraction (upper, lower)"),
    ("kept", ("dynamic_sampling/kept_fraction",), "groups kept by dynamic sampling"),
    ("eval", ("eval/avg@",), "held-out accuracy (avg@k)"),
)


def _series(records: list[dict], prefix: str) -> dict[str, list]:
    """{key: [(step, value)]} of the numeric keys equal to `prefix`, or starting with it when it
    ends in "@" (eval/avg@4, eval/avg@32, ...)."""
    out = {}
    for r in records:
        for key, value in r.items():
            match = key == prefix or (prefix.endswith("@") and key.startswith(prefix))
            if match and isinstance(value, (int, float)):
                out.setdefault(key, []).append((r["step"], value))
    return out


def _save(fig, path, dpi: int) -> None:
    """`fig` as a PNG at `path` (an epath: a local file or a URL)."""
    with path.open("wb") as f:
        fig.savefig(f, format="png", dpi=dpi)
    plt.close(fig)


def plot_runs(workdirs: list[str], out_dir: str) -> list[str]:
    """Write the panels' PNGs for `workdirs` (local folders or URLs) into `out_dir`; returns the
    paths written."""
    runs = {}
    for w in workdirs:
        path = paths.run_path(w) / JSONL
        if not path.is_file():
            raise FileNotFoundError(f"{path} does not exist: is {w} a dapo_jax workdir?")
        runs[paths.run_path(w).name] = read_jsonl(path)
    out = paths.run_path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    cols = -(-len(PANELS) // 2)
    fig_all, axes_all = plt.subplots(2, cols, figsize=(5 * cols, 7.2))
    axes_all = axes_all.ravel()
    for unused in axes_all[len(PANELS) :]:
        unused.axis("off")
    for (name, keys, title), ax_all in zip(PANELS, axes_all):
        fig, ax = plt.subplots(figsize=(5, 3.6))
        for axis in (ax, ax_all):
            for run, records in runs.items():
                for prefix in keys:
                    for key, pts in _series(records, prefix).items():
                        axis.plot(*zip(*pts), label=f"{run} {key.split('/')[-1]}", marker=".")
            axis.set_title(title)
            axis.set_xlabel("step")
            if axis.lines:
                axis.legend(fontsize=7)
        fig.tight_layout()
        _save(fig, out / f"{name}.png", 100)
        written.append(str(out / f"{name}.png"))
    fig_all.tight_layout()
    _save(fig_all, out / "curves.png", 80)
    return written + [str(out / "curves.png")]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("workdirs", nargs="+")
    parser.add_argument("--out", default=None, help="default: <first workdir>/plots")
    args = parser.parse_args(argv)
    out = args.out or str(paths.run_path(args.workdirs[0]) / "plots")
    for path in plot_runs(args.workdirs, out):
        print(path)


if __name__ == "__main__":
    main()

"""Metrics writers: real TensorBoard event files, JSONL truncated on resume, plots of several runs."""

import glob
import os
import struct
import subprocess
import sys

from tensorboardX.proto import event_pb2

from dapo_jax import metrics, plot


def _tb_scalars(workdir):
    """(tag, step, value) of every scalar in a workdir's event files, read as TFRecords."""
    out = []
    for path in sorted(glob.glob(os.path.join(workdir, "tensorboard", "events.*"))):
        data = open(path, "rb").read()
        i = 0
        while i < len(data):
            (n,) = struct.unpack("<Q", data[i : i + 8])
            event = event_pb2.Event.FromString(data[i + 12 : i + 12 + n])
            i += 12 + n + 4
            out += [(v.tag, event.step, v.simple_value) for v in event.summary.value]
    return out


def test_jsonl_and_tensorboard_and_resume(tmp_path):
    w = metrics.MetricsWriter(str(tmp_path))
    for step in (1, 2, 3):
        w.write(step, {"data/acc_mean": step / 10, "actor/entropy": float("nan")})
    w.close()
    assert ("data/acc_mean", 2, 0.2) in [(t, s, round(v, 6)) for t, s, v in _tb_scalars(tmp_path)]
    records = metrics.read_jsonl(str(tmp_path / "metrics.jsonl"))
    assert [r["step"] for r in records] == [1, 2, 3]
    assert records[0]["actor/entropy"] == "nan"  # non-finite values are kept, as strings

    resumed = metrics.MetricsWriter(str(tmp_path), resume_step=1)  # checkpoint at 1, killed at 3
    resumed.write(2, {"data/acc_mean": 0.5})
    resumed.close()
    records = metrics.read_jsonl(str(tmp_path / "metrics.jsonl"))
    assert [(r["step"], r["data/acc_mean"]) for r in records] == [(1, 0.1), (2, 0.5)]


def test_a_run_without_tensorboard_or_plots_does_not_import_them(tmp_path):
    """tensorboardX imports torch when it is installed (~175 MiB resident), matplotlib and
    datasets take seconds: the trainer loads them only for the writer, the report and parquet
    files that need them."""
    heavy = "sorted({'torch', 'tensorboardX', 'matplotlib', 'datasets'} & set(sys.modules))"
    code = (
        "import sys; from dapo_jax import metrics, train; "
        f"metrics.MetricsWriter({str(tmp_path / 'a')!r}, writers='jsonl').close(); print({heavy}); "
        f"metrics.MetricsWriter({str(tmp_path / 'b')!r}).close(); print('tensorboardX' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["[]", "True"]  # the default writers include TensorBoard's


def test_console_line_shows_headline_figures():
    line = metrics.console_line(
        7,
        {"before_filter/acc_mean": 0.4567, "actor/entropy": 1.25, "data/acc_mean": 0.5, "eval/avg@4": 0.8125},
    )
    assert line == "step     7  acc 0.457  ent 1.250  held-out avg@4 0.812"


def test_plot_writes_one_png_per_panel_for_several_runs(tmp_path):
    for run, acc in (("a", 0.1), ("b", 0.3)):
        w = metrics.MetricsWriter(str(tmp_path / run))
        for step in range(3):
            w.write(
                step,
                {
                    "before_filter/acc_mean": acc + step / 10,
                    "eval/avg@4": acc,
                    "actor/entropy": 1.0,
                    "before_filter/length_mean": 20.0,
                    "actor/token_prob": 0.5,
                    "actor/pg_clipfrac_upper": 0.01,
                    "dynamic_sampling/kept_fraction": 0.75,
                },
            )
        w.close()
    paths = plot.plot_runs([str(tmp_path / "a"), str(tmp_path / "b")], str(tmp_path / "plots"))
    assert {os.path.basename(p) for p in paths} == {
        "acc.png",
        "entropy.png",
        "length.png",
        "token_prob.png",
        "clip.png",
        "kept.png",
        "eval.png",
        "curves.png",
    }
    assert all(open(p, "rb").read(8) == b"\x89PNG\r\n\x1a\n" for p in paths)


def test_recipe_names_by_hand():
    ours = {
        "data/score_mean": 0.5,
        "actor/pg_clipfrac_upper": 0.01,
        "actor/pg_clipfrac_lower": 0.02,
        "actor/pg_clipfrac_dual": 0.003,
        "actor/entropy": 1.5,
        "dynamic_sampling/gen_batches": 3,
    }
    assert metrics.recipe_names(ours) == {
        "critic/score/mean": 0.5,
        "actor/pg_clipfrac_upper": 0.01,
        "actor/pg_clipfrac_eps_low": 0.02,  # ours, renamed: the recipe's "lower" is dual
        "actor/pg_clipfrac_lower": 0.003,
        "actor/entropy": 1.5,
        "train/num_gen_batches": 3,
        "actor/pg_clipfrac": 0.03,
    }  # clipped at either bound

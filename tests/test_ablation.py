"""The ablation study command: a quick study runs, resumes, and reports its table and figures;
the report's figures from hand-made metrics."""

import json
import os

import numpy as np
import pytest

from dapo_jax import ablation, ablation_report, metrics


def test_run_summary_by_hand():
    records = [
        {"step": 0, "eval/avg@4": 0.40},
        {
            "step": 1,
            "before_filter/acc_mean": 0.5,
            "dynamic_sampling/prompts_consumed": 3,
            "actor/pg_clipfrac_upper": 0.01,
            "actor/entropy": 0.9,
            "before_filter/length_mean": 10,
            "before_filter/truncated_mean": 0.5,
        },
        {
            "step": 2,
            "before_filter/acc_mean": 0.6,
            "dynamic_sampling/prompts_consumed": 5,
            "actor/pg_clipfrac_upper": 0.03,
            "actor/entropy": 0.7,
            "before_filter/length_mean": 14,
            "before_filter/truncated_mean": 0.0,
            "eval/avg@4": 0.55,
        },
    ]
    s = ablation_report.run_summary(records, group_size=4)
    assert (s["before"], s["after"], s["generated"]) == (0.40, 0.55, 32)  # (3 + 5) x G
    assert s["clip_upper"] == pytest.approx(0.02) and s["truncated"] == 0.25
    assert (s["entropy"], s["length"]) == (0.7, 14)  # the last quarter: the last step
    assert s["evals"] == [(0, 0.40, 0), (2, 0.55, 32)]
    assert ablation_report._first_reaching(s["evals"], 0.5) == (2, 32)
    assert ablation_report._first_reaching(s["evals"], 0.6) is None


@pytest.mark.slow
def test_quick_study_runs_resumes_and_reports(tmp_path):
    workdir, out = str(tmp_path / "study"), str(tmp_path / "report")
    args = ["run", "--scale=tiny", "--seeds=1", "--rows=dynamic_sampling", f"--workdir={workdir}", "--quick"]
    ablation.main(args)
    for row in ("dynamic_sampling", ablation.SFT_CONTROL):
        records = metrics.read_jsonl(os.path.join(workdir, row, "seed0", metrics.JSONL))
        assert [r["step"] for r in records] == ([0, 2] if row == ablation.SFT_CONTROL else [0, 1, 2])
    sft_last = records[-1]
    assert sft_last["sft/updates"] == 4 and np.isfinite(sft_last["sft/loss"])
    # A finished study is skipped: nothing is trained or written again.
    stamps = {
        r: os.path.getmtime(os.path.join(workdir, r, "seed0", metrics.JSONL))
        for r in ("dynamic_sampling", ablation.SFT_CONTROL)
    }
    ablation.main(args)
    assert stamps == {r: os.path.getmtime(os.path.join(workdir, r, "seed0", metrics.JSONL)) for r in stamps}

    ablation.main(["report", workdir, f"--out={out}"])
    table = open(os.path.join(out, "table.md")).read()
    assert json.load(open(os.path.join(workdir, ablation.STUDY_FILE)))["quick"]
    lines = {
        line.split("|")[1].strip(): line
        for line in table.splitlines()
        if line.startswith("| ") and not line.startswith("| row")
    }
    assert "not run" in lines["clip_higher"] and "not run" not in lines["dynamic_sampling"]
    assert lines["dynamic_sampling"].split("|")[2].strip() == "50"  # the paper's number
    assert set(lines) == set(ablation.load_config_file("configs/ablation.py").ROW_NAMES) | {
        ablation.SFT_CONTROL
    }
    for name, *_ in ablation_report.FIGURES:
        assert os.path.getsize(os.path.join(out, name)) > 1000


def test_unknown_row_is_refused(tmp_path):
    with pytest.raises(ValueError, match="clip_higher"):
        ablation.run_study("configs/ablation.py", "tiny", [0], str(tmp_path), rows=["clip_hi"])

"""experiments/smollm2_report.py: the paired gain and its standard error by hand, compliance, the
completions table; the smollm2_135m config's data: word problems whose held-out arithmetic is
never in the training file, scored by the last number."""

import os
import sys

import pyarrow.parquet as pq
import pytest

from configs import dapo
from dapo_jax import math_answers, synthetic

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "experiments"))
import smollm2_report  # noqa: E402


def _row(pid, sample, acc, response="12 + 7 = 19.", pred="19"):
    prompt = "<|im_start|>system\nsys<|im_end|>\n<|im_start|>user\n"
    prompt += f"problem {pid}<|im_end|>\n<|im_start|>assistant\n"
    return dict(
        problem_id=pid,
        sample=sample,
        prompt=prompt,
        response=response,
        pred=pred,
        ground_truth="19",
        acc=acc,
        score=1.0 if acc else -1.0,
        length=7,
        truncated=False,
    )


def test_paired_gain_by_hand():
    # per-problem accuracy before (0, 0.5, 0.5) and after (0.5, 1, 0.5): differences 0.5, 0.5, 0
    before = [_row(0, 0, False), _row(0, 1, False), _row(1, 0, True), _row(1, 1, False)]
    before += [_row(2, 0, True), _row(2, 1, False)]
    after = [_row(0, 0, True), _row(0, 1, False), _row(1, 0, True), _row(1, 1, True)]
    after += [_row(2, 0, False), _row(2, 1, True)]
    s = smollm2_report.summary(before, after)
    assert s["problems"] == 3
    assert s["before"]["avg"] == pytest.approx(1 / 3) and s["after"]["avg"] == pytest.approx(2 / 3)
    assert s["gain"] == pytest.approx(1 / 3)
    # sample std of (0.5, 0.5, 0) is sqrt(1/12); over sqrt(3): 1/6
    assert s["gain_se"] == pytest.approx(1 / 6)
    assert s["gain_in_se"] == pytest.approx(2.0)
    assert s["before"]["samples_per_problem"] == 2


def test_compliance_and_table():
    rows = [
        _row(0, 0, True),
        _row(0, 1, False, "Answer: 3", "3"),
        _row(1, 0, False, "no idea", math_answers.INVALID),
    ]
    c = smollm2_report.compliance(rows)
    assert c["readable"] == pytest.approx(2 / 3) and c["answer_line"] == pytest.approx(1 / 3)
    table = smollm2_report.completions_table(rows, [_row(0, 0, True, "a | b\nc", "19"), _row(1, 0, True)])
    lines = table.splitlines()
    assert len(lines) == 4 and lines[2].startswith(
        "| problem 0 | 19 | 12 + 7 = 19. | 19 | ✓ | a \\| b<br>c |"
    )
    assert "| no idea | [INVALID] | ✗ |" in lines[3]


def test_smollm2_data_is_held_out_and_scored_by_the_last_number():
    c = dapo.get_config("smollm2_135m")
    assert c.reward.fn == "last_number" and c.data.use_chat_template
    train = pq.read_table(os.path.join(REPO, c.data.train_files[0])).to_pylist()
    test = pq.read_table(os.path.join(REPO, c.data.eval_files[0])).to_pylist()
    chains = lambda rows: {r["extra_info"]["expression"] for r in rows}
    assert not chains(train) & chains(test)
    for row in test[:50]:
        solution, truth = row["extra_info"]["solution"], row["reward_model"]["ground_truth"]
        assert math_answers.last_number_score(solution, truth)["acc"]
    # the command in data/smollm2/README.md
    train_again, test_again = synthetic.make_splits(
        4000, 300, 0, min_operands=2, max_operands=2, max_operand=30, style="word"
    )
    assert (train_again, test_again) == (train, test)


def test_step_split_by_hand():
    """Two steps after the first: medians of 2 values are their means. A model of N = 1000
    parameters; generation batches of 2 prompts x G = 4, prompts of 10 tokens."""
    step = lambda s, gen, length, rollout_s, train_tokens, train_s: {
        "step": s,
        "dynamic_sampling/gen_batches": gen,
        "before_filter/length_mean": length,
        "timing/rollout_s": rollout_s,
        "timing/train_s": train_s,
        "timing/step_s": rollout_s + train_s,
        "throughput/train_tokens_per_s": train_tokens / train_s,
    }
    records = [step(1, 9, 99, 99, 99, 99), step(2, 1, 5, 2.0, 300, 3.0), step(3, 2, 10, 4.0, 600, 3.0)]
    got = smollm2_report.step_split(records, params=1000, gen_prompts=2, group=4, prompt_tokens=10)
    # rollout FLOPs 2 x 1000 x gen x 2 x (10 + 4 x length): step 2 120,000 in 2 s, step 3 400,000 in 4 s
    # update FLOPs 6 x 1000 x tokens: 1.8e6 in 3 s and 3.6e6 in 3 s
    assert got["steps"] == 3 and got["rollout_s"] == 3.0 and got["update_s"] == 3.0 and got["step_s"] == 6.0
    assert got["rollout_gflops"] == pytest.approx((60_000 + 100_000) / 2 / 1e9)
    assert got["update_gflops"] == pytest.approx((600_000 + 1_200_000) / 2 / 1e9)

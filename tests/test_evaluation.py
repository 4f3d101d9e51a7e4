"""avg@k, pass@k and maj@k on a hand-made table of samples."""

import math

import pytest

from dapo_jax import evaluation

# problem: [(pred, acc)] in sample order; n = 4 samples each.
TABLE = {
    "A": [("5", True), ("5", True), ("7", False), ("[INVALID]", False)],  # c = 2
    "B": [("3", False), ("4", True), ("3", False), ("4", True)],  # c = 2, 2-2 tie
    "C": [("9", False), ("9", False), ("9", False), ("9", False)],  # c = 0
    "D": [("1", True), ("[INVALID]", False), ("[INVALID]", False), ("[TIMEOUT]", False)],  # c = 1
}


def records():
    """Samples of the four problems interleaved, in sample order within each problem."""
    return [
        {"problem_id": pid, "pred": TABLE[pid][i][0], "acc": TABLE[pid][i][1]}
        for i in range(4)
        for pid in TABLE
    ]


def test_metrics_by_hand():
    metrics = evaluation.evaluate(records())
    expected = {
        "num_problems": 4,
        "samples_per_problem": 4,
        "avg@4": (2 / 4 + 2 / 4 + 0 + 1 / 4) / 4,  # 0.3125
        # per-problem .5, .5, 0, .25: squared deviations .035156 x 2, .097656, .003906
        "se_avg@4": math.sqrt((2 * 0.1875**2 + 0.3125**2 + 0.0625**2) / 3) / 2,
        "pass@1": 0.3125,
        "pass@2": ((1 - 1 / 6) + (1 - 1 / 6) + 0 + (1 - 3 / 6)) / 4,  # C(2,2)/C(4,2), C(3,2)/C(4,2)
        "pass@4": 3 / 4,  # any correct
        "maj@1": (1 + 0 + 0 + 1) / 4,  # first samples only
        "maj@2": (1 + 0.5 + 0 + 1) / 4,  # B: "3" vs "4" tie
        "maj@4": (1 + 0.5 + 0 + 1) / 4,  # D: non-answers do not vote
        # standard errors of the per-problem values: pass@1 is c / n again; pass@4 1, 1, 0, 1
        # (mean .75, squared deviations .0625 x 3 and .5625); pass@2 5/6, 5/6, 0, 1/2;
        # maj@1 1, 0, 0, 1 (deviations .5); maj@2 and maj@4 1, .5, 0, 1 (mean .625).
        "se_pass@1": math.sqrt((2 * 0.1875**2 + 0.3125**2 + 0.0625**2) / 3) / 2,
        "se_pass@2": math.sqrt(sum((x - 13 / 24) ** 2 for x in (5 / 6, 5 / 6, 0, 1 / 2)) / 3) / 2,
        "se_pass@4": math.sqrt((3 * 0.0625 + 0.5625) / 3) / 2,  # 0.25
        "se_maj@1": math.sqrt(4 * 0.25 / 3) / 2,
        "se_maj@2": math.sqrt((2 * 0.375**2 + 0.125**2 + 0.625**2) / 3) / 2,
        "se_maj@4": math.sqrt((2 * 0.375**2 + 0.125**2 + 0.625**2) / 3) / 2,
    }
    assert metrics.keys() == expected.keys()
    for key, value in expected.items():
        assert metrics[key] == pytest.approx(value), key
    assert metrics["pass@2"] == pytest.approx(13 / 24)


def test_chosen_ks():
    metrics = evaluation.evaluate(records(), ks=[3])
    # pass@3: A, B: 1 - C(2,3)/C(4,3) = 1; D: 1 - C(3,3)/C(4,3) = 3/4.
    assert metrics["pass@3"] == pytest.approx((1 + 1 + 0 + 0.75) / 4)
    assert set(metrics) == {
        "num_problems",
        "samples_per_problem",
        "avg@4",
        "se_avg@4",
        "pass@3",
        "se_pass@3",
        "maj@3",
        "se_maj@3",
    }


def test_pass_at_k_and_majority_pieces():
    assert evaluation.pass_at_k(5, 2, 3) == pytest.approx(1 - 1 / 10)
    assert evaluation.pass_at_k(32, 0, 8) == 0.0
    assert evaluation.pass_at_k(32, 25, 8) == 1.0  # fewer than 8 wrong samples
    with pytest.raises(ValueError):
        evaluation.pass_at_k(4, 1, 5)
    assert evaluation.majority_correct(["[INVALID]", "[ERROR]"], [False, False]) == 0.0
    # Three-way tie, one right: a random tie-break is right one time in three.
    assert evaluation.majority_correct(["1", "2", "3"], [True, False, False]) == pytest.approx(1 / 3)
    assert evaluation.majority_correct(["2", "1", "2"], [False, True, False]) == 0.0
    assert evaluation.default_ks(32) == [1, 2, 4, 8, 16, 32]
    assert evaluation.default_ks(5) == [1, 2, 4, 5]


def test_uneven_or_empty_records_rejected():
    with pytest.raises(ValueError, match="same number of samples"):
        evaluation.evaluate(records()[:-1])
    with pytest.raises(ValueError, match="no evaluation records"):
        evaluation.evaluate([])


def test_held_out_text_gives_standard_errors_and_the_gain():
    before = {"eval/avg@4": 0.40, "eval/se_avg@4": 0.03, "eval/pass@1": 0.40}
    after = {"eval/avg@4": 0.60, "eval/se_avg@4": 0.04}
    assert evaluation.summary_text(before) == "avg@4 0.400 ± 0.030  pass@1 0.400"
    # gain 0.2, se sqrt(0.03^2 + 0.04^2) = 0.05: 4 standard errors.
    assert evaluation.gain_text(before, after) == "held-out gain: +0.200 ± 0.050 (+4.0 standard errors)"
    assert evaluation.gain_text({"eval/avg@4": 0.4}, after) is None

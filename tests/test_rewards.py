"""math_dapo and math_verify rewards on hand-written responses, the overlong penalty, and failure
containment."""

import logging
import os
import sys
import time

import numpy as np
import pytest

from dapo_jax import math_answers, rewards

PAD = "x" * 400  # pushes earlier text out of the last 300 characters

# (response, ground truth, acc, pred): each verdict is what the DAPO recipe's own scorer (verl
# math_dapo.py `compute_score` at commit 4f80e465) returns for the pair, run on it once and
# written here. Several are surprising and are the point: "41." and "\boxed{41}." are wrong,
# "50%" is not "50", "-1,000" keeps its comma, "7 mm" is "7mm", "1,2" is "12", an "Answer:" on
# one line may take its value from the next, and an empty prediction equals an empty truth.
CASES = [
    # plain integers and the Answer: line
    ("Answer: 42", "42", True, "42"),
    ("answer: 42", "42", True, "42"),
    ("ANSWER:42", "42", True, "42"),
    ("Answer : 42", "42", True, "42"),
    ("so\nanswer : 42", "42", True, "42"),
    ("Answer:\t42", "42", True, "42"),
    ("Answer: 42 ", "42", True, "42"),
    ("Answer: 041", "41", False, "041"),
    ("Answer: 41", "42", False, "41"),
    ("Final Answer: 42", "42", True, "42"),
    ("The final answer: 42", "42", True, "42"),
    # trailing punctuation
    ("Answer: 41.", "41", False, "41."),
    ("Answer: 41!", "41", False, "41!"),
    ("Answer: $41$.", "41", True, "41"),
    ("Answer: $41.$", "41", True, "41"),
    ("Answer: 41,", "41", True, "41"),
    ("Answer: 41;", "41", False, "41;"),
    # dollars and boxes
    ("Answer: $41$", "41", True, "41"),
    ("Answer: $ 41 $", "41", True, "41"),
    ("Answer: $$41$$", "41", False, ""),
    ("Answer: \\$41", "41", True, "41"),
    ("Answer: $41$ \\quad", "41", True, "41"),
    ("Answer: $41$ (final)", "41", True, "41"),
    ("Answer: The answer is $12$.", "12", True, "12"),
    ("Answer: \\boxed{41}", "41", True, "41"),
    ("Answer: \\boxed{41}.", "41", False, "41."),
    ("Answer: $\\boxed{41}$", "41", True, "41"),
    ("Answer: $\\boxed{41}$.", "41", True, "41"),
    ("Answer: \\boxed{\\frac{1}{2}}", "\\frac{1}{2}", True, "\\frac{1}{2}"),
    ("Answer: $\\boxed{\\text{42}}$.", "42", True, "42"),
    ("Answer: \\fbox{41}", "41", False, "\\fbox{41}"),
    ("Answer: $x$ is $41$", "41", False, "x"),
    ("Answer: $$", "42", False, ""),
    ("Answer: \\boxed{}", "42", False, ""),
    # equals signs
    ("Answer: x = 7", "7", True, "7"),
    ("Answer: $x=7$", "7", True, "7"),
    ("Answer: 3 + 4 = 7", "7", True, "7"),
    ("Answer: x = 7, y = 8", "8", True, "8"),
    ("Answer: 7", "x = 7", True, "7"),
    ("Answer: a = 5", "5", True, "5"),
    # units and words
    ("Answer: 7 mm", "7", False, "7mm"),
    ("Answer: 7 cm", "7", True, "7"),
    ("Answer: 7 km", "7", True, "7"),
    ("Answer: 42 degrees", "42", True, "42"),
    ("Answer: 42^\\circ", "42", True, "42"),
    ("Answer: 42^{\\circ}", "42", True, "42"),
    ("Answer: 42 dollars", "42", True, "42"),
    ("Answer: 12 inches", "12", True, "12"),
    ("Answer: 12 feet", "12", True, "12"),
    ("Answer: 5 hours", "5", True, "5"),
    ("Answer: 5 minutes", "5", True, "5"),
    ("Answer: 12 \\text{m}", "12", True, "12"),
    ("Answer: 12 \\text{ m}", "12", True, "12"),
    ("Answer: 10 \\text{ cm}", "10", True, "10"),
    ("Answer: 10", "10 cm", True, "10"),
    ("Answer: 11 cm", "10 cm", False, "11"),
    ("Answer: 6 ways", "6", True, "6"),
    ("Answer: 8 points", "8", True, "8"),
    ("Answer: 3 students", "3", True, "3"),
    ("Answer: 9 square units", "9", True, "9"),
    ("Answer: 9 units^2", "9", False, "9^2"),
    ("Answer: 12 \\text{s}", "12", True, "12"),
    ("Answer: 12th", "12", False, "12th"),
    ("Answer: 12\\mathrm{th}", "12", True, "12"),
    ("Answer: 12 apples", "12", False, "12apples"),
    ("Answer: 4 meters", "4", True, "4"),
    ("Answer: 4 metres", "4", False, "4metres"),
    # articles
    ("Answer: a 12", "12", True, "12"),
    ("Answer: an 8", "8", True, "8"),
    ("Answer: 12 a", "12", False, "12a"),
    ("Answer: banana 12", "12", False, "banan12"),
    # percent
    ("Answer: 50%", "50", False, "50%"),
    ("Answer: 50\\%", "50", False, "50\\%"),
    ("Answer: 50\\%", "50\\%", True, "50\\%"),
    ("Answer: 50%", "50%", True, "50%"),
    # thousands separators
    ("Answer: 1,000", "1000", True, "1000"),
    ("Answer: -1,000", "-1000", False, "-1,000"),
    ("Answer: 1{,}000", "1000", True, "1000"),
    ("Answer: 1,\\!000", "1000", True, "1000"),
    ("Answer: 1\\,000", "1000", False, "1\\,000"),
    ("Answer: 1 000", "1000", True, "1000"),
    ("Answer: 1,2", "12", True, "12"),
    ("Answer: 1,000.5", "1000.5", False, "1,000.5"),
    ("Answer: 12,345,678", "12345678", True, "12345678"),
    # negative numbers and unicode minus
    ("Answer: -7", "-7", True, "-7"),
    ("Answer: -7", "7", False, "-7"),
    ("Answer: −7", "-7", False, "−7"),
    ("Answer: −7", "−7", True, "−7"),
    ("Answer: - 7", "-7", True, "-7"),
    ("Answer: $-7$", "-7", True, "-7"),
    ("Answer: (-7)", "-7", False, "(-7)"),
    # fractions and their shorthands
    ("Answer: \\frac12", "\\frac{1}{2}", True, "\\frac{1}{2}"),
    ("Answer: \\frac{1}{2}", "\\frac12", True, "\\frac{1}{2}"),
    ("Answer: \\dfrac{1}{2}", "\\frac{1}{2}", False, "\\dfrac{1}{2}"),
    ("Answer: 1/2", "\\frac{1}{2}", False, "1/2"),
    ("Answer: \\frac{1}{2}", "0.5", False, "\\frac{1}{2}"),
    ("Answer: \\frac123", "\\frac{1}{2}3", True, "\\frac{1}{2}3"),
    ("Answer: \\tfrac{3}{4}", "\\frac{3}{4}", False, "\\tfrac{3}{4}"),
    ("Answer: \\frac {1}{2}", "\\frac{1}{2}", True, "\\frac{1}{2}"),
    ("Answer: \\sqrt2", "\\sqrt{2}", True, "\\sqrt{2}"),
    ("Answer: 2\\sqrt3", "2\\sqrt{3}", True, "2\\sqrt{3}"),
    ("Answer: \\sqrt{8}", "2\\sqrt{2}", False, "\\sqrt{8}"),
    ("Answer: \\sqrt 2", "\\sqrt{2}", True, "\\sqrt{2}"),
    # \text{} and friends
    ("Answer: \\text{42}", "42", True, "42"),
    ("Answer: \\textbf{42}", "42", True, "42"),
    ("Answer: \\mbox{42}", "42", True, "42"),
    ("Answer: \\overline{42}", "42", True, "42"),
    ("Answer: 3 \\text{and} 4", "3,4", True, "34"),
    ("Answer: 3, \\text{and} 4", "3,4", True, "34"),
    ("Answer: \\text{(A)}", "(A)", True, "(A)"),
    ("Answer: (A)", "A", False, "(A)"),
    ("Answer: \\text{Yes}", "Yes", True, "Yes"),
    # lists, intervals, expressions
    ("Answer: (1,2)", "(1,2)", True, "(1,2)"),
    ("Answer: (1, 2)", "(1,2)", True, "(1,2)"),
    ("Answer: \\left(1,2\\right)", "(1,2)", False, "\\left(1,2\\right)"),
    ("Answer: [0, 1)", "[0,1)", True, "[0,1)"),
    ("Answer: 2, 3", "2,3", True, "23"),
    ("Answer: 3, 2", "2,3", False, "32"),
    ("Answer: x^2+1", "x^2 + 1", True, "x^2+1"),
    ("Answer: 0.50", "0.5", False, "0.50"),
    ("Answer: 2.0", "2", False, "2.0"),
    ("Answer: \\pi", "\\pi", True, "\\pi"),
    # several Answer: lines, none, the 300-character window
    ("Answer: 3\nAnswer: 5", "5", True, "5"),
    ("Answer: 5\nAnswer: 3", "5", False, "3"),
    ("Answer: 5 Answer: 3", "3", False, "5Answer:3"),
    ("Answer: 42" + PAD, "42", False, "[INVALID]"),
    ("Answer: 1\n" + PAD + "\nAnswer: 2", "2", True, "2"),
    (PAD + "Answer: 42", "42", True, "42"),
    ("x" * 295 + "Answer: 42", "42", True, "42"),
    ("Answer: 42" + "y" * 292, "42", False, "[INVALID]"),
    ("Answer: 42\n" + "y" * 289, "42", True, "42"),
    ("the answer is 42", "42", False, "[INVALID]"),
    ("", "42", False, "[INVALID]"),
    ("Answer:", "42", False, "[INVALID]"),
    ("Answer: \n42", "42", True, "42"),
    ("\\boxed{42}", "42", False, "[INVALID]"),
    ("Answer: [INVALID]", "[INVALID]", True, "[INVALID]"),
    # empty and odd ground truths
    ("Answer: $$", "", True, ""),
    ("Answer: 42", "", False, "42"),
    ("Answer: 42", " 42 ", True, "42"),
    ("Answer: 42", "$42$", True, "42"),
    ("Answer: 42", "\\boxed{42}", True, "42"),
]


def test_battery_is_large_and_mixed():
    assert len(CASES) >= 100
    assert 40 <= sum(acc for _, _, acc, _ in CASES) <= len(CASES) - 40


@pytest.mark.parametrize("response,ground_truth,acc,pred", CASES)
def test_math_dapo_score(response, ground_truth, acc, pred):
    result = math_answers.math_dapo_score(response, ground_truth)
    assert result == {"score": 1.0 if acc else -1.0, "acc": acc, "pred": pred}


# (response, ground truth, acc, pred): the last number of the tail, by hand
LAST_NUMBER_CASES = [
    ("17 + 25 = 42.", "42", True, "42"),
    ("17 + 25 = 32.", "42", False, "32"),
    ("The answer is 1,234 apples", "1234", True, "1234"),
    ("Answer: 42\n", "42", True, "42"),
    ("He has -3 left.", "-3", True, "-3"),
    ("He has -3 left.", "3", False, "-3"),
    ("12 - 15 = 3", "-3", False, "3"),
    ("It is 42.0", "42", True, "42.0"),
    ("42 is it, after 7 tries", "42", False, "7"),
    ("no number here", "5", False, math_answers.INVALID),
    ("x" * 400 + " 42 " + "y" * 300, "42", False, math_answers.INVALID),  # outside the last 300 characters
    ("3", "three", False, "3"),
]


@pytest.mark.parametrize("response,ground_truth,acc,pred", LAST_NUMBER_CASES)
def test_last_number_score(response, ground_truth, acc, pred):
    result = math_answers.last_number_score(response, ground_truth)
    assert result == {"score": 1.0 if acc else -1.0, "acc": acc, "pred": pred}


def test_registry_by_name():
    assert rewards.get_reward_fn("math_dapo") is math_answers.math_dapo_score
    assert rewards.get_reward_fn("last_number") is math_answers.last_number_score
    with pytest.raises(ValueError, match="math_dapo"):
        rewards.get_reward_fn("no_such_reward")


# (response, ground truth, acc): symbolic equivalents that string equality rejects, and misses
VERIFY_CASES = [
    ("Answer: 0.5", "1/2", True),
    ("Answer: \\frac{1}{2}", "0.5", True),
    ("Answer: 2\\sqrt{2}", "\\sqrt{8}", True),
    ("Answer: \\pi/2", "\\frac{\\pi}{2}", True),
    ("Answer: $\\boxed{\\frac{3}{4}}$.", "0.75", True),
    ("Answer: x = 7", "7", True),
    ("Answer: 10 \\text{ cm}", "10", True),
    ("Answer: 3/4", "0.7", False),
    ("Answer: 2\\sqrt{3}", "\\sqrt{8}", False),
    ("Answer: 41", "42", False),
    ("Answer: $$", "42", False),
]


@pytest.mark.parametrize("response,ground_truth,acc", VERIFY_CASES)
def test_math_verify_score(response, ground_truth, acc):
    result = math_answers.math_verify_score(response, ground_truth)
    assert (result["score"], result["acc"]) == (1.0 if acc else -1.0, acc)
    assert result["pred"] == math_answers.math_dapo_score(response, ground_truth)["pred"]


def test_math_verify_in_worker_processes():
    responses = [r for r, _, _ in VERIFY_CASES] + ["the answer is 42"]
    truths = [g for _, g, _ in VERIFY_CASES] + ["42"]
    with rewards.RewardScorer(rewards.get_reward_fn("math_verify"), num_workers=2) as scorer:
        results, stats = scorer.score_batch(responses, truths)
    assert [r["acc"] for r in results] == [a for _, _, a in VERIFY_CASES] + [False]
    assert results[-1]["pred"] == math_answers.INVALID and stats == {"n_error": 0, "n_timeout": 0}


def test_math_verify_missing_names_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)  # makes `import math_verify` fail
    with pytest.raises(ImportError, match="pip install math-verify"):
        rewards.get_reward_fn("math_verify")


@pytest.mark.parametrize(
    "length,expected",
    [
        (0, 0.0),
        (5, 0.0),
        (6, 0.0),  # L <= L_max - L_buf = 6: no penalty
        (7, -0.25),
        (8, -0.5),
        (9, -0.75),
        (10, -1.0),  # L = L_max: exactly -factor
    ],
)
def test_overlong_penalty_boundaries(length, expected):
    assert rewards.overlong_penalty(length, max_len=10, buffer_len=4) == expected


def test_overlong_penalty_factor_and_batch():
    # DAPO: L_max 20480, L_buf 4096, so expected length 16384.
    assert rewards.overlong_penalty(16384 + 1024, 20480, 4096, factor=0.5) == -0.125
    got = rewards.overlong_penalties([3, 7, 10], max_len=10, buffer_len=4, factor=2.0)
    np.testing.assert_array_equal(got, [0.0, -0.5, -2.0])
    assert not np.signbit(got[0])
    np.testing.assert_array_equal(
        rewards.overlong_penalties([3, 7, 10], 10, 4, enabled=False), [0.0, 0.0, 0.0]
    )
    with pytest.raises(ValueError):
        rewards.overlong_penalties([3], max_len=10, buffer_len=0)


def test_overlong_filter_mask():
    truncated = np.array([False, True, False])
    np.testing.assert_array_equal(rewards.overlong_filter_mask(truncated), [True, False, True])
    np.testing.assert_array_equal(rewards.overlong_filter_mask(truncated, enabled=False), [True, True, True])


def flaky_reward(response_text, ground_truth):
    """Raises on "BOOM", hangs on "HANG", returns garbage on "JUNK", dies on "DIE", else math_dapo."""
    if "DIE" in response_text:
        os._exit(3)
    if "BOOM" in response_text:
        raise ValueError("checker exploded")
    if "HANG" in response_text:
        time.sleep(60)
    if "JUNK" in response_text:
        return "not a dict"
    return math_answers.math_dapo_score(response_text, ground_truth)


def test_scorer_contains_errors_and_hangs(caplog):
    responses = ["Answer: 1", "BOOM 1", "HANG", "Answer: 4", "BOOM 2", "JUNK", "Answer: 9"]
    truths = ["1", "2", "3", "4", "5", "6", "7"]
    with (
        caplog.at_level(logging.WARNING),
        rewards.RewardScorer(flaky_reward, timeout_s=0.5, num_workers=2) as scorer,
    ):
        start = time.monotonic()
        results, stats = scorer.score_batch(responses, truths)
        assert time.monotonic() - start < 20
        assert [r["pred"] for r in results] == ["1", "[ERROR]", "[TIMEOUT]", "4", "[ERROR]", "[ERROR]", "9"]
        assert [r["acc"] for r in results] == [True, False, False, True, False, False, False]
        assert [r["score"] for r in results] == [1.0, -1.0, -1.0, 1.0, -1.0, -1.0, -1.0]
        assert stats == {"n_error": 3, "n_timeout": 1}
        # Logged once per kind, with the offending text.
        messages = [r.getMessage() for r in caplog.records if "reward fn" in r.getMessage()]
        assert len(messages) == 2
        assert "BOOM" in messages[0] and "checker exploded" in messages[0]
        assert "HANG" in messages[1]
        # The scorer goes on after replacing the hung worker.
        results, stats = scorer.score_batch(["Answer: 5", "HANG", "DIE", "Answer: 8"], ["5", "5", "5", "8"])
        assert [r["pred"] for r in results] == ["5", "[TIMEOUT]", "[ERROR]", "8"]
        assert stats == {"n_error": 1, "n_timeout": 1}
        assert scorer.totals == {"n_error": 4, "n_timeout": 2}
        assert len([r for r in caplog.records if "reward fn" in r.getMessage()]) == 2


def test_score_batch_one_off():
    results, stats = rewards.score_batch(
        math_answers.math_dapo_score, ["Answer: 3", "no"], ["3", "3"], num_workers=1
    )
    assert [r["acc"] for r in results] == [True, False]
    assert stats == {"n_error": 0, "n_timeout": 0}


PLUGIN = """
import time

def score(response, ground_truth, *, data_source, extra_info):
    if "HANG" in response:
        time.sleep(60)
    if "BOOM" in response:
        raise RuntimeError("plug-in exploded")
    right = response.strip() == ground_truth
    return {"score": 2.0 if right else -0.5, "acc": right,
            "pred": f"{data_source}|{extra_info['tag'] if extra_info else None}"}

def just_a_float(response, ground_truth, *, data_source, extra_info):
    return float(len(response)) - 2.0

NOT_A_FUNCTION = 3
"""


def test_plugin_from_a_file_runs_in_the_workers_with_the_rows_context(tmp_path, caplog):
    (tmp_path / "my_reward.py").write_text(PLUGIN)
    fn = rewards.get_reward_fn(f"{tmp_path}/my_reward.py:score")
    contexts = [{"data_source": "aime", "extra_info": {"tag": i}} for i in range(5)]
    with caplog.at_level(logging.WARNING), rewards.RewardScorer(fn, timeout_s=0.5, num_workers=2) as scorer:
        results, stats = scorer.score_batch(
            ["7", "8", "BOOM", "HANG", "9"], ["7", "7", "7", "7", "9"], contexts
        )
    assert results == [
        {"score": 2.0, "acc": True, "pred": "aime|0"},
        {"score": -0.5, "acc": False, "pred": "aime|1"},
        {"score": -1.0, "acc": False, "pred": rewards.ERROR},
        {"score": -1.0, "acc": False, "pred": rewards.TIMEOUT},
        {"score": 2.0, "acc": True, "pred": "aime|4"},
    ]
    assert stats == {"n_error": 1, "n_timeout": 1}
    # A float is the score; acc is score > 0; no prediction.
    results, _ = rewards.score_batch(
        rewards.get_reward_fn(f"{tmp_path}/my_reward.py:just_a_float"),
        ["abc", "a"],
        ["x", "y"],
        num_workers=1,
    )
    assert results == [{"score": 1.0, "acc": True, "pred": ""}, {"score": -1.0, "acc": False, "pred": ""}]


def test_plugin_by_module_name(tmp_path, monkeypatch):
    (tmp_path / "my_reward_module.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    fn = rewards.get_reward_fn("my_reward_module:score")
    results, _ = rewards.score_batch(fn, ["7"], ["7"], num_workers=1)
    assert results[0]["score"] == 2.0 and results[0]["pred"] == "|None"  # no context passed


@pytest.mark.parametrize(
    "spec,message",
    [
        (
            "{tmp}/missing.py:score",
            "reward.fn '{tmp}/missing.py:score': file {tmp}/missing.py does not exist",
        ),
        (
            "no_such_module_xyz:score",
            "reward.fn 'no_such_module_xyz:score': no module named 'no_such_module_xyz'",
        ),
        (
            "{tmp}/my_reward.py:nope",
            "reward.fn '{tmp}/my_reward.py:nope': {tmp}/my_reward.py has no "
            "function 'nope'; it defines ['just_a_float', 'score']",
        ),
        ("{tmp}/my_reward.py:NOT_A_FUNCTION", "has no function 'NOT_A_FUNCTION'"),
        ("no_such_reward", "unknown reward fn 'no_such_reward'"),
    ],
)
def test_bad_reward_spec_is_one_line_at_config_check(spec, message, tmp_path):
    from configs import dapo
    from dapo_jax import config_checks
    from dapo_jax.errors import ConfigError

    (tmp_path / "my_reward.py").write_text(PLUGIN)
    config = dapo.get_config("tiny")
    config.reward.fn = spec.format(tmp=tmp_path)
    with pytest.raises(ConfigError) as e:
        config_checks.check_config(config)
    assert message.format(tmp=tmp_path) in str(e.value) and "\n" not in str(e.value)

"""Synthetic arithmetic task: worked solutions, determinism, split hygiene, file formats."""

import json
import os
import re

import pyarrow.parquet as pq
import pytest

from dapo_jax import math_answers, synthetic

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_worked_solution_left_to_right():
    assert synthetic.worked_solution([12, 7, 5], "+-") == ("12+7=19\n19-5=14\nAnswer: 14", 14)
    assert synthetic.worked_solution([3, 10], "-") == ("3-10=-7\nAnswer: -7", -7)
    assert synthetic.problem_text([12, 7, 5], "+-") == "Compute 12+7-5."


def test_worked_solution_products_first():
    # 12+7*3-5 = 12+21-5 = 28
    assert synthetic.worked_solution([12, 7, 3, 5], "+*-") == ("7*3=21\n12+21=33\n33-5=28\nAnswer: 28", 28)
    # 2*3*4-1 = 23
    assert synthetic.worked_solution([2, 3, 4, 1], "**-") == ("2*3=6\n6*4=24\n24-1=23\nAnswer: 23", 23)


def test_rows_are_consistent_and_deterministic():
    rows = synthetic.generate(300, seed=5, min_operands=2, max_operands=5, ops="+-*")
    assert rows == synthetic.generate(300, seed=5, min_operands=2, max_operands=5, ops="+-*")
    assert rows != synthetic.generate(300, seed=6, min_operands=2, max_operands=5, ops="+-*")
    assert {row["extra_info"]["n_ops"] for row in rows} == {1, 2, 3, 4}
    for i, row in enumerate(rows):
        problem = row["prompt"][0]["content"]
        solution = row["extra_info"]["solution"]
        expression = problem[len("Compute ") : -1]
        assert row["reward_model"]["ground_truth"] == str(eval(expression))  # python precedence
        assert row["extra_info"]["index"] == i
        assert len(solution.split("\n")) == row["extra_info"]["n_ops"] + 1
        assert math_answers.math_dapo_score(solution, row["reward_model"]["ground_truth"])["acc"]
        assert set(problem + solution) <= set("0123456789+-*=.: \nComputeAnswer")


def test_difficulty_knob_bounds_and_errors():
    rows = synthetic.generate(50, seed=0, min_operands=6, max_operands=6, max_operand=3)
    for row in rows:
        assert row["extra_info"]["n_ops"] == 5
        numbers = row["prompt"][0]["content"][len("Compute ") : -1].replace("-", "+").split("+")
        assert all(1 <= int(n) <= 3 for n in numbers)
    with pytest.raises(ValueError):
        synthetic.generate(5, seed=0, min_operands=1)
    with pytest.raises(ValueError):
        synthetic.generate(5, seed=0, ops="+/")
    # The whole space of "a+b" with operands in {1} is one problem: excluding it cannot finish.
    with pytest.raises(ValueError, match="could not draw"):
        synthetic.generate(
            1, seed=0, max_operands=2, max_operand=1, ops="+", exclude=frozenset({"Compute 1+1."})
        )


def test_cli_writes_disjoint_splits(tmp_path):
    synthetic.main(
        [
            "--out",
            str(tmp_path),
            "--n_train",
            "200",
            "--n_test",
            "40",
            "--max_operands",
            "3",
            "--max_operand",
            "9",
        ]
    )
    train = pq.read_table(tmp_path / "train.parquet").to_pylist()
    test = pq.read_table(tmp_path / "test.parquet").to_pylist()
    assert (len(train), len(test)) == (200, 40)
    assert {r["extra_info"]["split"] for r in train} == {"train"}
    problems = lambda rows: {r["prompt"][0]["content"] for r in rows}
    assert not problems(train) & problems(test)
    assert train[0]["reward_model"]["style"] == "rule"
    assert train[0]["data_source"] == synthetic.DATA_SOURCE

    synthetic.main(
        [
            "--out",
            str(tmp_path),
            "--n_train",
            "200",
            "--n_test",
            "40",
            "--max_operands",
            "3",
            "--max_operand",
            "9",
            "--format",
            "jsonl",
        ]
    )
    with open(tmp_path / "train.jsonl") as f:
        assert [json.loads(line) for line in f] == train


def test_shipped_files_match_the_documented_command(tmp_path):
    train, test = synthetic.make_splits(4000, 500, seed=0)
    for name, rows in (("train", train), ("test", test)):
        shipped = pq.read_table(os.path.join(REPO, "data", "synthetic", f"{name}.parquet"))
        assert shipped.to_pylist() == rows


def test_word_problems_tell_the_same_chain_and_never_go_negative():
    rows = synthetic.generate(300, seed=3, min_operands=2, max_operands=5, max_operand=30, style="word")
    assert rows == synthetic.generate(
        300, seed=3, min_operands=2, max_operands=5, max_operand=30, style="word"
    )
    for row in rows:
        problem, expression = row["prompt"][0]["content"], row["extra_info"]["expression"]
        chain = expression[len("Compute ") : -1]
        assert row["reward_model"]["ground_truth"] == str(eval(chain))
        numbers = [int(x) for x in chain.replace("-", "+").split("+")]
        assert [int(w) for w in problem.replace(".", " ").split() if w.isdigit()] == numbers  # in order
        totals = [eval(chain[: m.start()]) for m in re.finditer(r"[+-]", chain)] + [eval(chain)]
        assert min(totals) >= 0
        assert (
            problem.endswith("have now?")
            and sum(problem.count(s) for s in (" more.", " away.", " loses ", " uses ")) == len(numbers) - 1
        )
    with pytest.raises(ValueError, match="word"):
        synthetic.generate(5, seed=0, ops="+*", style="word")


def test_word_splits_share_no_arithmetic():
    train, test = synthetic.make_splits(400, 100, seed=0, max_operands=2, max_operand=12, style="word")
    chains = lambda rows: {r["extra_info"]["expression"] for r in rows}
    assert len(chains(test)) > 50 and not chains(train) & chains(test)

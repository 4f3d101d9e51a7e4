"""A synthetic integer-answer maths task for CPU-scale RL, in the DAPO-Math-17k format.

A problem is a chain of n operands (the difficulty knob) joined by +, - (and optionally *),
evaluated with the usual precedence: "Compute 12+7*3-5." The worked solution does one
operation per line, products first, then left to right, and ends with the answer line that
math_dapo reads:

    7*3=21
    12+21=33
    33-5=28
    Answer: 28

so its length grows with the number of operations n - 1. Generation is deterministic in the seed.
The alphabet is small and ASCII: digits, "+-*=.: ", newline and the letters of "Compute Answer".

`style="word"` states the same chain (+ and - only) as a story for a real tokenizer, every running
total non-negative, the worked solution unchanged:

    Mia has 12 stickers. Then she gets 7 more. She gives 5 away. How many stickers does Mia have now?

Held-out problems never share their arithmetic (the chain of numbers and operators) with a
training problem, whatever the story around it.

Rows follow docs/dapo_spec.md section 7: `data_source`, `prompt` = [{"role": "user", "content": problem}]
(the bare problem; `data.py` applies the prompt template), `ability`, `reward_model`
{ground_truth: the integer as a string, style: "rule"}, `extra_info` {index, n_ops, solution, split}.
Test problems never appear in the train split.

The shipped files were made with
    python -m dapo_jax.synthetic --out data/synthetic --n_train 4000 --n_test 500 --seed 0
"""

import argparse
import itertools
import json
import os
import random

import pyarrow as pa
import pyarrow.parquet as pq

DATA_SOURCE = "synthetic_arith"


def worked_solution(numbers: list[int], ops: str) -> tuple[str, int]:
    """(one line per operation, products first then left to right, ending "Answer: v"; v)."""
    numbers, ops = list(numbers), list(ops)
    lines = []
    while "*" in ops:
        i = ops.index("*")
        value = numbers[i] * numbers[i + 1]
        lines.append(f"{numbers[i]}*{numbers[i + 1]}={value}")
        numbers[i : i + 2], ops[i : i + 1] = [value], []
    value = numbers[0]
    for op, number in zip(ops, numbers[1:]):
        new_value = value + number if op == "+" else value - number
        lines.append(f"{value}{op}{number}={new_value}")
        value = new_value
    lines.append(f"Answer: {value}")
    return "\n".join(lines), value


def problem_text(numbers: list[int], ops: str) -> str:
    """ "Compute 12+7-5." for numbers [12, 7, 5] and ops "+-"."""
    expression = str(numbers[0]) + "".join(op + str(n) for op, n in zip(ops, numbers[1:]))
    return f"Compute {expression}."


NAMES = (("Mia", "she", "her"), ("Leo", "he", "him"), ("Ava", "she", "her"), ("Sam", "he", "him"))
ITEMS = ("apples", "stickers", "marbles", "books", "coins", "pencils", "cards", "shells")
_MORE = ("Then {p} gets {n} more.", "{P} buys {n} more.", "A friend gives {o} {n} more.")
_LESS = ("{P} gives {n} away.", "Then {p} loses {n}.", "{P} uses {n} of them.")


def word_problem_text(numbers: list[int], ops: str, rng: random.Random) -> str:
    """The chain numbers[0] ops[0] numbers[1] ... as a story of one person's items (+ and - only)."""
    (name, p, o), item = rng.choice(NAMES), rng.choice(ITEMS)
    sentences = [f"{name} has {numbers[0]} {item}."]
    for op, n in zip(ops, numbers[1:]):
        template = rng.choice(_MORE if op == "+" else _LESS)
        sentences.append(template.format(p=p, P=p.capitalize(), o=o, n=n))
    sentences.append(f"How many {item} does {name} have now?")
    return " ".join(sentences)


def _draw(rng: random.Random, min_operands, max_operands, max_operand, ops, style):
    """(numbers, operators) of one problem; word problems redraw until no running total is < 0."""
    while True:
        n = rng.randint(min_operands, max_operands)
        numbers = [rng.randint(1, max_operand) for _ in range(n)]
        chosen_ops = "".join(rng.choice(ops) for _ in range(n - 1))
        signed = [x if op == "+" else -x for op, x in zip("+" + chosen_ops, numbers)]
        if style == "expression" or min(itertools.accumulate(signed)) >= 0:
            return numbers, chosen_ops


def generate(
    num_items: int,
    seed: int,
    *,
    min_operands: int = 2,
    max_operands: int = 6,
    max_operand: int = 20,
    ops: str = "+-",
    split: str = "train",
    exclude: frozenset = frozenset(),
    style: str = "expression",
) -> list[dict]:
    """`num_items` rows; the operand count n is uniform in [min_operands, max_operands],
    operands uniform in [1, max_operand], operators uniform over `ops`; `style` "expression"
    ("Compute 12+7-5.") or "word" (`word_problem_text`). Problems whose expression text
    ("Compute 12+7-5.") is in `exclude` are redrawn (duplicates within the split are allowed)."""
    if not 2 <= min_operands <= max_operands or max_operand < 1 or not set(ops) <= set("+-*"):
        raise ValueError(
            f"bad difficulty: operands {min_operands}..{max_operands}, max_operand {max_operand}, ops {ops!r}"
        )
    if style not in ("expression", "word") or (style == "word" and "*" in ops):
        raise ValueError(f"bad style {style!r} with ops {ops!r}: 'expression', or 'word' with + and - only")
    rng = random.Random(seed)
    rows, attempts = [], 0
    while len(rows) < num_items:
        attempts += 1
        if attempts > 100 * num_items:
            raise ValueError(f"could not draw {num_items} problems outside `exclude`; widen the difficulty")
        numbers, chosen_ops = _draw(rng, min_operands, max_operands, max_operand, ops, style)
        problem = problem_text(numbers, chosen_ops)
        if problem in exclude:
            continue
        extra = {}
        if style == "word":
            extra, problem = {"expression": problem}, word_problem_text(numbers, chosen_ops, rng)
        solution, answer = worked_solution(numbers, chosen_ops)
        rows.append(
            {
                "data_source": DATA_SOURCE,
                "prompt": [{"role": "user", "content": problem}],
                "ability": "arithmetic",
                "reward_model": {"ground_truth": str(answer), "style": "rule"},
                "extra_info": {
                    "index": len(rows),
                    "n_ops": len(chosen_ops),
                    "solution": solution,
                    "split": split,
                    **extra,
                },
            }
        )
    return rows


def write_parquet(rows: list[dict], path: str):
    pq.write_table(pa.Table.from_pylist(rows), path)


def write_jsonl(rows: list[dict], path: str):
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def make_splits(n_train: int, n_test: int, seed: int, **difficulty) -> tuple[list, list]:
    """(train rows, test rows); the test split is drawn first and its expressions excluded from
    train."""
    test = generate(n_test, seed + 1, split="test", **difficulty)
    exclude = frozenset(row["extra_info"].get("expression", row["prompt"][0]["content"]) for row in test)
    return generate(n_train, seed, split="train", exclude=exclude, **difficulty), test


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--n_train", type=int, default=4000)
    parser.add_argument("--n_test", type=int, default=500)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--min_operands", type=int, default=2)
    parser.add_argument("--max_operands", type=int, default=6)
    parser.add_argument("--max_operand", type=int, default=20)
    parser.add_argument("--ops", default="+-", help="operators to draw from, a subset of '+-*'")
    parser.add_argument("--style", choices=("expression", "word"), default="expression")
    parser.add_argument("--format", choices=("parquet", "jsonl"), default="parquet")
    args = parser.parse_args(argv)
    train, test = make_splits(
        args.n_train,
        args.n_test,
        args.seed,
        min_operands=args.min_operands,
        max_operands=args.max_operands,
        max_operand=args.max_operand,
        ops=args.ops,
        style=args.style,
    )
    os.makedirs(args.out, exist_ok=True)
    write = write_parquet if args.format == "parquet" else write_jsonl
    for name, rows in (("train", train), ("test", test)):
        path = os.path.join(args.out, f"{name}.{args.format}")
        write(rows, path)
        print(f"wrote {len(rows)} rows to {path}")


if __name__ == "__main__":
    main()

"""Evaluation metrics over n samples per problem (docs/dapo_spec.md section 7). Host code; no jax.

For a problem with n samples of which c are correct:
  avg@n   mean accuracy, c / n, averaged over problems (DAPO reports avg@32 on AIME 2024),
          with its standard error over problems (se_avg@n);
  pass@k  P(at least one of k samples drawn without replacement is correct), the unbiased
          estimator 1 - C(n-c, k) / C(n, k); when k == n it is 1 if c > 0 else 0;
  maj@k   (cons@k) correctness of the most frequent normalised answer among the first k samples.
          Non-answers (INVALID, ERROR, TIMEOUT, empty) do not vote; none left means wrong.
          Ties are scored by expected correctness under a uniformly random tie-break (the
          fraction of tied answers that are correct), so the result does not depend on sample
          order within the vote. An answer's correctness is the mean `acc` of its samples.
Each of them comes with its standard error over problems (se_*: the standard deviation of the
per-problem values over sqrt(number of problems)), the uncertainty of a finite problem set.
"""

import collections
import math
import statistics

from dapo_jax.math_answers import INVALID
from dapo_jax.rewards import ERROR, TIMEOUT

_NON_ANSWERS = {INVALID, ERROR, TIMEOUT, ""}


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct: 1 - C(n-c, k) / C(n, k)."""
    if not 1 <= k <= n or not 0 <= c <= n:
        raise ValueError(f"need 1 <= k <= n and 0 <= c <= n, got n={n}, c={c}, k={k}")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def majority_correct(preds: list, accs: list) -> float:
    """maj@len(preds) of one problem: credit of the majority answer, ties split (module doc)."""
    votes, correct = collections.Counter(), collections.defaultdict(list)
    for pred, acc in zip(preds, accs):
        if pred not in _NON_ANSWERS:
            votes[pred] += 1
            correct[pred].append(float(acc))
    if not votes:
        return 0.0
    top = max(votes.values())
    tied = [pred for pred, count in votes.items() if count == top]
    return sum(sum(correct[p]) / len(correct[p]) for p in tied) / len(tied)


def standard_error(values: list) -> float:
    """stdev(values) / sqrt(len(values)); NaN for fewer than two values."""
    if len(values) < 2:
        return float("nan")
    return statistics.stdev(values) / math.sqrt(len(values))


def default_ks(n: int) -> list:
    """1, 2, 4, ... up to n, and n."""
    return sorted({2**i for i in range(n.bit_length()) if 2**i <= n} | {n})


def evaluate(records, ks=None) -> dict:
    """Metrics from per-sample records, dicts with "problem_id", "pred" (normalised), "acc".

    Every problem must have the same number n of samples; `ks` defaults to `default_ks(n)`.
    Returns {"avg@n", "pass@k" and "maj@k" for each k, each with its standard error over
    problems ("se_avg@n", "se_pass@k", "se_maj@k"), "num_problems", "samples_per_problem"}.
    """
    by_problem = collections.defaultdict(list)
    for record in records:
        by_problem[record["problem_id"]].append((record["pred"], bool(record["acc"])))
    if not by_problem:
        raise ValueError("no evaluation records")
    counts = {pid: len(samples) for pid, samples in by_problem.items()}
    n = min(counts.values())
    if max(counts.values()) != n:
        raise ValueError(f"every problem needs the same number of samples, got {counts}")
    ks = default_ks(n) if ks is None else sorted(ks)
    metrics = {"num_problems": len(by_problem), "samples_per_problem": n}
    problems = list(by_problem.values())
    per_problem = [sum(a for _, a in s) / n for s in problems]
    metrics[f"avg@{n}"] = sum(per_problem) / len(problems)
    metrics[f"se_avg@{n}"] = standard_error(per_problem)
    for k in ks:
        passes = [pass_at_k(n, sum(a for _, a in s), k) for s in problems]
        majorities = [majority_correct([p for p, _ in s[:k]], [a for _, a in s[:k]]) for s in problems]
        metrics[f"pass@{k}"], metrics[f"se_pass@{k}"] = (sum(passes) / len(problems), standard_error(passes))
        metrics[f"maj@{k}"], metrics[f"se_maj@{k}"] = (
            sum(majorities) / len(problems),
            standard_error(majorities),
        )
    return metrics


def summary_text(m: dict) -> str:
    """ "avg@4 0.412 ± 0.015  pass@1 ... ± ...  maj@4 ..." of an evaluation's eval/ metrics."""
    parts = []
    for key, value in m.items():
        name = key.removeprefix("eval/")
        if key.startswith("eval/") and name.startswith(("avg@", "pass@", "maj@")):
            se = m.get(f"eval/se_{name}")
            parts.append(f"{name} {value:.3f}" + (f" ± {se:.3f}" if se is not None else ""))
    return "  ".join(parts)


def gain_text(before: dict, after: dict) -> str | None:
    """The avg@k gain and its standard error, sqrt(se_before^2 + se_after^2) (the two evaluations
    draw independent samples), or None when either lacks them."""
    key = next((k for k in after if k.startswith("eval/avg@")), None)
    se_key = key and key.replace("eval/", "eval/se_")
    if not key or key not in before or se_key not in before or se_key not in after:
        return None
    gain, se = after[key] - before[key], math.hypot(before[se_key], after[se_key])
    return (
        f"held-out gain: {gain:+.3f} ± {se:.3f} ({gain / se:+.1f} standard errors)"
        if se > 0
        else f"held-out gain: {gain:+.3f}"
    )

"""The math scorers (docs/dapo_spec.md section 6): score_i, acc_i and pred_i of one response o_i
against its ground truth, strings in and out, no jax.

  math_dapo:   the DAPO recipe's scorer, rule for rule (verl `verl/utils/reward_score/math_dapo.py`
               at the reproduction commit 4f80e465, the one behind AIME 2024 avg@32 = 50): the last
               300 characters of o_i, the last match of `(?i)Answer\\s*:\\s*([^\n]+)` there ("[INVALID]"
               when there is none), prediction and ground truth through `normalize_final_answer`;
               score_i = +1.0 if the two strings are equal else -1.0, acc_i = that bool,
               pred_i = the normalised prediction. Held-out numbers (eval/*) use it too.
  math_verify: the same extraction, equivalence decided by the optional `math-verify` package
               (symbolic: "1/2" equals "0.5"); not the paper's scorer, an option.
  last_number: the last number in the last 300 characters (lm-evaluation-harness's GSM8K
               "flexible-extract"), equal in value to an integer ground truth; for small
               instruct models that answer "17 + 25 = 42." and never write an "Answer:" line
               (an "Answer: 42" line ends in its number, so it scores the same).

`REWARD_FNS` names them for `reward.fn` (`rewards.get_reward_fn`).
"""

import importlib
import re

INVALID = "[INVALID]"  # no "Answer:" line in the last 300 characters
TAIL_CHARS = 300  # the recipe's window: "the longest answer in MATH-500 has 159 characters"
_ANSWER_RE = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")

# The recipe's normalisation (Minerva's, from lm-evaluation-harness's hendrycks_math), as data.
# Each entry is a plain replacement of every occurrence, applied in this order; the order is part
# of the rule: "an " and "a " go before the spaces do (so "a 12" is "12" but "12 a" is "12a"),
# "mbox" becomes "text" before the "\text{...}" rules, and "\text{m}" (metres) becomes "\text{}"
# before "\text{}" is deleted. Words are deleted wherever they occur, even inside other words.
_REPLACEMENTS = (
    ("an ", ""),
    ("a ", ""),
    (".$", "$"),
    ("\\$", ""),
    ("\\ ", ""),
    (" ", ""),
    ("mbox", "text"),
    (",\\text{and}", ","),
    ("\\text{and}", ","),
    ("\\text{m}", "\\text{}"),
)
_DELETIONS = (
    "square",
    "ways",
    "integers",
    "dollars",
    "mph",
    "inches",
    "hours",
    "km",
    "units",
    "\\ldots",
    "sue",
    "points",
    "feet",
    "minutes",
    "digits",
    "cents",
    "degrees",
    "cm",
    "gm",
    "pounds",
    "meters",
    "meals",
    "edges",
    "students",
    "childrentickets",
    "multiples",
    "\\text{s}",
    "\\text{.}",
    "\\text{\ns}",
    "\\text{}^2",
    "\\text{}^3",
    "\\text{\n}",
    "\\text{}",
    "\\mathrm{th}",
    "^\\circ",
    "^{\\circ}",
    "\\;",
    ",\\!",
    "{,}",
    '"',
    "\\dots",
)
# Regex rewrites, in order (`.` stops at a newline, as in the recipe):
_FIRST_INLINE_MATH = re.compile(r".*?\$(.*?)\$.*")  # a line with $..$ keeps its first $..$
_UNWRAPPED = tuple(
    re.compile("\\\\" + command + r"\{(.*?)\}")  # \text{X}, \textbf{X}, \overline{X}
    for command in ("text", "textbf", "overline")
)
_BOXED = re.compile(r"\\boxed\{(.*)\}")  # first "\boxed{" to the line's last "}"
_FRAC_SHORTHAND = re.compile(r"frac([^{])(.)")  # \frac12 -> \frac{1}{2}
_SQRT_SHORTHAND = re.compile(r"sqrt([^{])")  # \sqrt2 -> \sqrt{2}


def normalize_final_answer(answer: str) -> str:
    r"""The DAPO recipe's normal form of a final answer (its `normalize_final_answer`).

    1. keep what follows the last "=";
    2. `_REPLACEMENTS` (every space goes: "1 000" is "1000"), then `_DELETIONS`;
    3. a line holding "$...$" is reduced to its first such span; then \text{X}, \textbf{X},
       \overline{X} become X (the shortest braces), \boxed{X} becomes X (up to the last brace);
    4. the shorthands \fracab -> \frac{a}{b} and \sqrta -> \sqrt{a}; every "$" is dropped;
    5. when nothing but digits and commas is left, the commas go ("1,000" -> "1000", and so does
       "1,2" -> "12"; "-1,000" keeps its comma); surrounding whitespace is stripped.
    Nothing else: "41." and "50%" stay as they are, and "\frac{1}{2}" is not "0.5".
    """
    text = answer.split("=")[-1]
    for old, new in _REPLACEMENTS:
        text = text.replace(old, new)
    for word in _DELETIONS:
        text = text.replace(word, "")
    text = _FIRST_INLINE_MATH.sub(r"$\1$", text)
    for wrapper in _UNWRAPPED:
        text = wrapper.sub(r"\1", text)
    text = _BOXED.sub(r"\1", text)
    text = _FRAC_SHORTHAND.sub(r"frac{\1}{\2}", text)
    text = _SQRT_SHORTHAND.sub(r"sqrt{\1}", text).replace("$", "")
    if text.replace(",", "").isdigit():
        text = text.replace(",", "")
    return text.strip()


def extract_answer(response_text: str) -> str:
    """The text after the last "Answer:" within the last TAIL_CHARS characters, or INVALID."""
    matches = _ANSWER_RE.findall(response_text[-TAIL_CHARS:])
    return matches[-1] if matches else INVALID


def math_dapo_score(response_text: str, ground_truth: str) -> dict:
    """DAPO's math reward: {"score": ±1.0, "acc": bool, "pred": normalised answer}.

    As the recipe: a response without an "Answer:" line has pred INVALID (which no real ground
    truth equals), and an empty prediction equals an empty ground truth (data loading refuses
    rows without a ground truth).
    """
    pred = normalize_final_answer(extract_answer(response_text))
    acc = pred == normalize_final_answer(ground_truth)
    return {"score": 1.0 if acc else -1.0, "acc": acc, "pred": pred}


def math_verify_score(response_text: str, ground_truth: str) -> dict:
    """Second checker: the same extraction, equivalence by `math_verify.verify(parse(gt), parse(x))`
    with both read as LaTeX math (math_verify finds no LaTeX outside `$...$`: a bare "\\sqrt{8}"
    parses to nothing).

    Accepts symbolic equivalents ("1/2" and "0.5", "2\\sqrt{2}" and "\\sqrt{8}") that string
    equality rejects.
    """
    math_verify = import_math_verify()
    raw = extract_answer(response_text)
    if raw == INVALID:
        return {"score": -1.0, "acc": False, "pred": INVALID}
    as_math = lambda text: math_verify.parse("$" + text.replace("$", "").strip() + "$")
    acc = bool(math_verify.verify(as_math(ground_truth), as_math(raw)))
    return {"score": 1.0 if acc else -1.0, "acc": acc, "pred": normalize_final_answer(raw)}


_NUMBER_RE = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def last_number_score(response_text: str, ground_truth: str) -> dict:
    """{"score": ±1.0, "acc": bool, "pred": the last number of the response's last TAIL_CHARS
    characters, commas dropped, or INVALID}; acc when it equals the ground truth as a number
    ("42", "42.0" and "42," all equal "42"; "-3" is not "3")."""
    numbers = _NUMBER_RE.findall(response_text[-TAIL_CHARS:])
    if not numbers:
        return {"score": -1.0, "acc": False, "pred": INVALID}
    pred = numbers[-1].replace(",", "")
    try:
        acc = float(pred) == float(ground_truth.replace(",", "").strip())
    except ValueError:  # a ground truth that is not a number
        acc = False
    return {"score": 1.0 if acc else -1.0, "acc": acc, "pred": pred}


def import_math_verify():
    try:
        return importlib.import_module("math_verify")
    except ImportError as e:
        raise ImportError("reward fn 'math_verify' needs an optional package: pip install math-verify") from e


REWARD_FNS = {
    "math_dapo": math_dapo_score,
    "math_verify": math_verify_score,
    "last_number": last_number_score,
}

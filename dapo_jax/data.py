"""Prompt data: DAPO-Math-17k / AIME-format files, templated and tokenised (a Hub dataset id in
the config is resolved to its cached local files first, `hub.resolve_config`).

Rows follow docs/dapo_spec.md section 7: `prompt` (list of {role, content}), `reward_model.ground_truth`
(string), optional `data_source`, `extra_info`. Loading a file:
  1. reads it: parquet with `datasets`; jsonl line by line with `json`, so one bad line is one
     malformed row rather than a failed file;
  2. skips malformed rows (prompt not a non-empty list ending in a message with non-empty
     string content, ground truth not a non-empty string, undecodable line), logging each with
     its row index (up to a cap) and then a count;
  3. takes the problem from the last message, prompt[-1]["content"] (earlier messages, none in
     DAPO's files, are dropped). DAPO's files already hold the spec-section-6 template around
     the problem; when the content is wrapped in exactly that template it is unwrapped first, so
     the configured `template` is applied once, whichever it is. Content that quotes the
     template's instructions without being wrapped in it exactly (a character differs) is kept
     as it is, so it ends up wrapped twice: such rows are counted (`n_template_mismatch`) and
     logged;
  4. deduplicates on the problem text, keeping the first row (switch `dedup`): the published
     DAPO-Math-17k repeats each of ~17.4k prompts ~100 times, which would otherwise weight the
     prompt order and epoch counts by the copies. Without dedup, copies share a `problem_id`.
     Evaluation files always load deduplicated (`run.build`): AIME 2024's 30 problems x 32
     copies become 30 problems, each sampled `eval.samples` (32) times for avg@32;
  5. puts the problem into `template` ("{problem}" marks where), then through the tokenizer's
     chat template as one user message when it has one and `use_chat_template` is set, else
     uses the plain text; tokenises (special tokens added only for plain text: a chat template
     writes its own); truncates from the LEFT to `max_prompt_len` tokens (docs/dapo_spec.md section 8).

Tokenizer note: in transformers 5, `AutoTokenizer` on a directory whose config says qwen2 forces
`Qwen2Tokenizer`, which drops the spaces of a custom tokenizer; load a custom one with
`transformers.PreTrainedTokenizerFast(tokenizer_file=...)`.
"""

import dataclasses
import json
import logging
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from dapo_jax.errors import DataFileError

DEFAULT_TEMPLATE = (
    "Solve the following math problem step by step. The last line of your response should be of "
    "the form Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
    '{problem}\n\nRemember to put your answer on its own line after "Answer:".'
)


@dataclasses.dataclass(frozen=True)
class PromptSet:
    """Loaded examples and what loading did. Each example is a dict with keys prompt_ids
    (list[int]), prompt_text (the templated text, before truncation), ground_truth (str),
    index (row in the file), problem_id (dense id of the problem text), data_source (str),
    extra_info (the row's dict, else None; a reward plug-in gets it), solution
    (`extra_info.solution`, a worked solution where the file has one, else None)."""

    examples: list
    n_rows: int  # rows in the file
    n_malformed: int  # rows skipped as malformed
    n_duplicates: int  # rows dropped by deduplication
    n_truncated: int  # prompts cut from the left to max_prompt_len
    n_template_mismatch: int  # rows quoting DEFAULT_TEMPLATE's instructions, not wrapped in it


class _Malformed(ValueError):
    pass


def check_data_file(path: str) -> None:
    """Raises DataFileError unless `path` is a .parquet file with rows (read from its footer, no
    rows loaded) or a .jsonl/.json file with a non-blank line: cheap checks before anything runs."""
    if not os.path.exists(path):
        raise DataFileError(
            f"data file {path!r} does not exist; put the parquet/jsonl file there "
            "or point the config's data path at it"
        )
    if os.path.isdir(path):
        raise DataFileError(f"data file {path!r} is a directory, not a .parquet or .jsonl file")
    if path.endswith(".parquet"):
        try:
            n_rows = pq.ParquetFile(path).metadata.num_rows
        except (pa.ArrowException, OSError) as e:
            raise DataFileError(
                f"data file {path!r} is not a readable parquet file ({' '.join(str(e).split())})"
            ) from None
        if not n_rows:
            raise DataFileError(f"data file {path!r} has no rows")
    elif path.endswith((".jsonl", ".json")):
        with open(path, "rb") as f:
            if not any(line.strip() for line in f):
                raise DataFileError(f"data file {path!r} has no rows")
    else:
        raise DataFileError(f"data file {path!r}: expected a .parquet or .jsonl file")


def _read_rows(path: str):
    """Yields rows (dicts, or _Malformed for an undecodable jsonl line) of a local file."""
    check_data_file(path)
    if path.endswith(".parquet"):
        import datasets  # noqa: PLC0415 - ~0.9 s and ~60 MiB to import, for parquet files only

        table = datasets.load_dataset("parquet", data_files=path, split="train")
        for batch in table.iter(batch_size=4096):
            columns = list(batch)
            for values in zip(*batch.values()):
                yield dict(zip(columns, values))
    else:
        with open(path) as f:
            for line in f:
                try:
                    yield json.loads(line)
                except json.JSONDecodeError as e:
                    yield _Malformed(f"not JSON ({e})")


def _problem_and_answer(row) -> tuple[str, str]:
    """(problem text, ground truth) of a row, or raises _Malformed saying why."""
    if isinstance(row, _Malformed):
        raise row
    if not isinstance(row, dict):
        raise _Malformed(f"row is a {type(row).__name__}, not a mapping")
    prompt = row.get("prompt")
    if not isinstance(prompt, list) or not prompt or not isinstance(prompt[-1], dict):
        raise _Malformed("prompt is not a non-empty list of {role, content} messages")
    content = prompt[-1].get("content")
    if not isinstance(content, str) or not content.strip():
        raise _Malformed("the last prompt message has no string content")
    reward_model = row.get("reward_model")
    answer = reward_model.get("ground_truth") if isinstance(reward_model, dict) else None
    if not isinstance(answer, str) or not answer.strip():
        raise _Malformed(f"reward_model.ground_truth is {answer!r}, not a non-empty string")
    return unwrap_default_template(content), answer


def unique_rows(path: str, seen: set | None = None) -> tuple[list[dict], int, int, int]:
    """The well-formed rows of a local file, the first of each problem text (the dedup key of
    `load_prompts`) not already in `seen` (updated), as they are: (rows, rows read, malformed
    rows, duplicates dropped)."""
    rows, seen = [], set() if seen is None else seen
    n_rows = n_malformed = n_duplicates = 0
    for row in _read_rows(path):
        n_rows += 1
        try:
            problem, _ = _problem_and_answer(row)
        except _Malformed:
            n_malformed += 1
            continue
        if problem in seen:
            n_duplicates += 1
            continue
        seen.add(problem)
        rows.append(row)
    return rows, n_rows, n_malformed, n_duplicates


# Sentences of DEFAULT_TEMPLATE that a problem of its own would not contain.
_TEMPLATE_MARKERS = (
    "The last line of your response should be of the form Answer:",
    "Remember to put your answer on its own line after",
)


def quotes_default_template(content: str) -> bool:
    """Whether `content` holds DEFAULT_TEMPLATE's instructions without being wrapped in it."""
    return unwrap_default_template(content) == content and any(
        marker in content for marker in _TEMPLATE_MARKERS
    )


def unwrap_default_template(content: str) -> str:
    """The problem inside `DEFAULT_TEMPLATE`, or `content` itself when not wrapped in it."""
    head, tail = DEFAULT_TEMPLATE.split("{problem}")
    if content.startswith(head) and content.endswith(tail) and len(content) > len(head + tail):
        return content[len(head) : len(content) - len(tail)]
    return content


def format_prompt(
    problem: str, tokenizer, template: str = DEFAULT_TEMPLATE, use_chat_template: bool = True
) -> str:
    """`template` with the problem in place of "{problem}", in the chat template if used."""
    if template.count("{problem}") != 1:
        raise ValueError(f"prompt template must contain '{{problem}}' once: {template!r}")
    text = template.replace("{problem}", problem)
    if use_chat_template and getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
        )
    return text


def _example(row: dict, index: int, problem_id: int, prompt_text: str, answer: str) -> dict:
    """The loaded example of file row `index` (its optional fields checked, not trusted)."""
    data_source, extra = row.get("data_source"), row.get("extra_info")
    solution = extra.get("solution") if isinstance(extra, dict) else None
    return {
        "prompt_text": prompt_text,
        "ground_truth": answer,
        "index": index,
        "problem_id": problem_id,
        "data_source": data_source if isinstance(data_source, str) else "",
        "extra_info": extra if isinstance(extra, dict) else None,
        "solution": solution if isinstance(solution, str) else None,
    }


def load_prompts(
    path: str,
    tokenizer,
    max_prompt_len: int,
    *,
    template: str = DEFAULT_TEMPLATE,
    use_chat_template: bool = True,
    dedup: bool = True,
    max_warnings: int = 10,
) -> PromptSet:
    """Loads, checks, deduplicates, templates and tokenises a prompt file (see module doc)."""
    if max_prompt_len < 1:
        raise ValueError(f"max_prompt_len must be positive, got {max_prompt_len}")
    chat = use_chat_template and bool(getattr(tokenizer, "chat_template", None))
    if use_chat_template and not chat:
        logging.warning("the tokenizer has no chat template: prompts are plain templated text")
    kept, problem_ids = [], {}
    n_rows = n_malformed = n_duplicates = n_mismatch = 0
    for index, row in enumerate(_read_rows(path)):
        n_rows += 1
        try:
            problem, answer = _problem_and_answer(row)
        except _Malformed as e:
            n_malformed += 1
            if n_malformed <= max_warnings:
                logging.warning("%s: row %d skipped: %s", path, index, e)
            continue
        if problem in problem_ids and dedup:
            n_duplicates += 1
            continue
        if quotes_default_template(problem):
            n_mismatch += 1
            if n_mismatch <= max_warnings:
                logging.warning(
                    "%s: row %d quotes the DAPO prompt template but is not wrapped in "
                    "it exactly; it keeps its wording and gets the configured template "
                    "around it",
                    path,
                    index,
                )
        problem_id = problem_ids.setdefault(problem, len(problem_ids))
        kept.append(
            _example(row, index, problem_id, format_prompt(problem, tokenizer, template, chat), answer)
        )
    if n_malformed:
        logging.warning("%s: skipped %d malformed rows of %d", path, n_malformed, n_rows)
    if n_mismatch:
        logging.warning(
            "%s: %d rows quote the DAPO prompt template without being wrapped in it", path, n_mismatch
        )
    if not kept:
        raise DataFileError(f"data file {path!r} has no usable rows ({n_rows} rows, {n_malformed} malformed)")
    encoded = tokenizer([ex["prompt_text"] for ex in kept], add_special_tokens=not chat)
    n_truncated = 0
    for example, ids in zip(kept, encoded["input_ids"]):
        n_truncated += len(ids) > max_prompt_len
        example["prompt_ids"] = list(ids[-max_prompt_len:])
    return PromptSet(kept, n_rows, n_malformed, n_duplicates, n_truncated, n_mismatch)


class PromptIterator:
    """Deterministic, resumable batches of examples: a fresh seeded shuffle each epoch.

    The order of epoch e is `default_rng([seed, e]).permutation(N)`, so `state()` — a few ints —
    is all a checkpoint needs; `next_batch(n)` wraps across epochs.
    """

    def __init__(self, examples: list, seed: int = 0):
        if not examples:
            raise ValueError("PromptIterator needs at least one example")
        self._examples, self._seed = examples, seed
        self._set(epoch=0, position=0)

    def _set(self, epoch: int, position: int):
        self._epoch, self._position = epoch, position
        self._order = np.random.default_rng([self._seed, epoch]).permutation(len(self._examples))

    @property
    def examples(self) -> list:
        """Every example, in load order."""
        return self._examples

    def next_batch(self, n: int) -> list[dict]:
        batch = []
        while len(batch) < n:
            if self._position == len(self._examples):
                self._set(self._epoch + 1, 0)
            take = min(n - len(batch), len(self._examples) - self._position)
            batch += [self._examples[i] for i in self._order[self._position : self._position + take]]
            self._position += take
        return batch

    def state(self) -> dict:
        return {
            "seed": self._seed,
            "epoch": self._epoch,
            "position": self._position,
            "num_examples": len(self._examples),
        }

    def restore(self, state: dict):
        if int(state["num_examples"]) != len(self._examples):
            raise ValueError(
                f"iterator state is for {int(state['num_examples'])} examples, "
                f"this data has {len(self._examples)}"
            )
        self._seed = int(state["seed"])
        self._set(int(state["epoch"]), int(state["position"]))


def pad_prompts(ids_list: list, length: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Left-pads prompts to `length` tokens (the sampler re-pads to its smallest bucket).

    Returns (tokens_PxQ int32, mask_PxQ bool), Q = `length`, mask True on real tokens; left
    padding puts every prompt's last token in column Q-1, where generation starts.
    """
    if not ids_list:
        raise ValueError("pad_prompts needs at least one prompt")
    longest = max(len(ids) for ids in ids_list)
    if longest > length:
        raise ValueError(
            f"a prompt of {longest} tokens is longer than {length}; raise "
            "data.max_prompt_len or truncate the prompt"
        )
    tokens_PxQ = np.full((len(ids_list), length), pad_id, np.int32)
    mask_PxQ = np.zeros((len(ids_list), length), bool)
    for p, ids in enumerate(ids_list):
        if ids:
            tokens_PxQ[p, length - len(ids) :] = ids
            mask_PxQ[p, length - len(ids) :] = True
    return tokens_PxQ, mask_PxQ

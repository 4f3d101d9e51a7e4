"""Prompt loading (templating, truncation, malformed rows, dedup), the iterator, pad_prompts."""

import json
import logging
import string

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import tokenizers
import transformers
from tokenizers import Regex, models, pre_tokenizers

from dapo_jax import data

SPECIALS = ["<pad>", "<|im_start|>", "<|im_end|>"]
VOCAB = {t: i for i, t in enumerate(SPECIALS + sorted(set(string.printable)))}
CHAT = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def char_tokenizer(chat_template=CHAT):
    """One token per character, plus three special tokens."""
    tok = tokenizers.Tokenizer(models.WordLevel(VOCAB, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.add_special_tokens(SPECIALS)
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>")
    tokenizer.chat_template = chat_template
    return tokenizer


def ids_of(text):
    return [VOCAB[c] for c in text]


def row(content, answer="7", source="math_dapo"):
    return {
        "data_source": source,
        "prompt": [{"role": "user", "content": content}],
        "ability": "MATH",
        "reward_model": {"ground_truth": answer, "style": "rule"},
        "extra_info": {"index": 0},
    }


def test_unwrap_and_format_prompt():
    templated = data.DEFAULT_TEMPLATE.replace("{problem}", "What is 3+4?")
    assert data.unwrap_default_template(templated) == "What is 3+4?"
    assert data.unwrap_default_template("What is 3+4?") == "What is 3+4?"
    tokenizer = char_tokenizer()
    assert data.format_prompt("P", tokenizer, "Q: {problem}\n", use_chat_template=False) == "Q: P\n"
    assert data.format_prompt("P", tokenizer, "Q: {problem}\n") == (
        "<|im_start|>user\nQ: P\n<|im_end|>\n<|im_start|>assistant\n"
    )
    # Without a chat template the plain text is used even when asked for the chat template.
    assert data.format_prompt("P", char_tokenizer(None), "Q: {problem}") == "Q: P"
    # Braces in the template other than {problem} are literal.
    assert data.format_prompt("P", tokenizer, "\\boxed{} {problem}", False) == "\\boxed{} P"
    with pytest.raises(ValueError, match="problem"):
        data.format_prompt("P", tokenizer, "no placeholder", False)


def test_load_parquet_dedup_template_truncation(tmp_path):
    templated = data.DEFAULT_TEMPLATE.replace("{problem}", "Compute 1+2.")
    rows = [
        row(templated, "3"),
        row("Compute 5-1.", "4"),
        row("Compute 1+2.", "3"),
        row(templated, "3"),
        row("Compute 2+2+2+2.", "8"),
    ]
    path = str(tmp_path / "train.parquet")
    pq.write_table(pa.Table.from_pylist(rows), path)
    tokenizer = char_tokenizer()

    loaded = data.load_prompts(
        path, tokenizer, max_prompt_len=12, template="{problem}\n", use_chat_template=False
    )
    # Rows 0, 2, 3 are one problem (row 0 and 3 wrapped in DAPO's template): two duplicates.
    assert (loaded.n_rows, loaded.n_malformed, loaded.n_duplicates) == (5, 0, 2)
    assert [ex["index"] for ex in loaded.examples] == [0, 1, 4]
    assert [ex["problem_id"] for ex in loaded.examples] == [0, 1, 2]
    assert [ex["ground_truth"] for ex in loaded.examples] == ["3", "4", "8"]
    assert [ex["prompt_text"] for ex in loaded.examples] == [
        "Compute 1+2.\n",
        "Compute 5-1.\n",
        "Compute 2+2+2+2.\n",
    ]
    # 13, 13 and 17 characters, truncated from the left to 12.
    assert [ex["prompt_ids"] for ex in loaded.examples] == [
        ids_of("ompute 1+2.\n"),
        ids_of("ompute 5-1.\n"),
        ids_of("te 2+2+2+2.\n"),
    ]
    assert loaded.n_truncated == 3
    assert loaded.examples[1]["data_source"] == "math_dapo"

    copies = data.load_prompts(
        path, tokenizer, max_prompt_len=100, template="{problem}", use_chat_template=False, dedup=False
    )
    assert copies.n_duplicates == 0
    assert [ex["problem_id"] for ex in copies.examples] == [0, 1, 0, 0, 2]

    chat = data.load_prompts(path, tokenizer, max_prompt_len=1000)
    expected = "<|im_start|>user\n" + templated + "<|im_end|>\n<|im_start|>assistant\n"
    assert chat.examples[0]["prompt_text"] == expected
    assert chat.examples[0]["prompt_ids"] == (
        [VOCAB["<|im_start|>"]]
        + ids_of("user\n" + templated)
        + [VOCAB["<|im_end|>"]]
        + ids_of("\n")
        + [VOCAB["<|im_start|>"]]
        + ids_of("assistant\n")
    )


def test_malformed_rows_are_skipped_and_counted(tmp_path, caplog):
    lines = [
        json.dumps(row("Compute 1+1.", "2")),
        json.dumps(row("Compute 1+3.", 4)),  # ground truth not a string
        "{not json",
        json.dumps({"prompt": [], "reward_model": {"ground_truth": "1"}}),  # empty prompt
        json.dumps({"prompt": "Compute 2+2.", "reward_model": {"ground_truth": "4"}}),
        json.dumps(row("   ", "1")),  # blank content
        json.dumps({"prompt": [{"role": "user", "content": "Compute 9-1."}]}),  # no answer
        json.dumps(row("Compute 3+3.", "6")),
    ]
    path = tmp_path / "mixed.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with caplog.at_level(logging.WARNING):
        loaded = data.load_prompts(str(path), char_tokenizer(), 64, template="{problem}", max_warnings=3)
    assert (loaded.n_rows, loaded.n_malformed) == (8, 6)
    assert [ex["index"] for ex in loaded.examples] == [0, 7]
    messages = [r.getMessage() for r in caplog.records]
    row_lines = [m for m in messages if "skipped:" in m]
    assert len(row_lines) == 3  # capped
    assert "row 1 " in row_lines[0] and "row 2 " in row_lines[1] and "row 3 " in row_lines[2]
    assert any("skipped 6 malformed rows of 8" in m for m in messages)


def test_rows_that_quote_the_template_inexactly_are_counted(tmp_path, caplog):
    exact = data.DEFAULT_TEMPLATE.replace("{problem}", "Compute 1+2.")
    one_off = exact.replace("Remember", "remember")  # one character differs
    rows = [
        row(exact, "3"),
        row(one_off, "3"),
        row("Compute 2+2.", "4"),
        row(exact.replace("Answer: $Answer", "Answer:$Answer"), "3"),
    ]
    path = str(tmp_path / "train.parquet")
    pq.write_table(pa.Table.from_pylist(rows), path)
    with caplog.at_level(logging.WARNING):
        loaded = data.load_prompts(path, char_tokenizer(), 1000, use_chat_template=False)
    assert loaded.n_template_mismatch == 2 and loaded.n_duplicates == 0
    texts = [ex["prompt_text"] for ex in loaded.examples]
    assert texts[0] == exact and texts[1] == data.DEFAULT_TEMPLATE.replace("{problem}", one_off)
    assert any("2 rows quote the DAPO prompt template" in r.getMessage() for r in caplog.records)


def test_missing_path_and_empty_file(tmp_path):
    with pytest.raises(data.DataFileError, match="nowhere.parquet' does not exist"):
        data.load_prompts(str(tmp_path / "nowhere.parquet"), char_tokenizer(), 8)
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{}\n")
    with pytest.raises(ValueError, match="no usable rows"):
        data.load_prompts(str(bad), char_tokenizer(), 8)


def test_iterator_epochs_determinism_and_resume():
    examples = [{"index": i} for i in range(5)]
    indices = lambda batch: [ex["index"] for ex in batch]
    it = data.PromptIterator(examples, seed=3)
    first_epoch = indices(it.next_batch(2) + it.next_batch(3))
    assert sorted(first_epoch) == [0, 1, 2, 3, 4]
    assert it.state() == {"seed": 3, "epoch": 0, "position": 5, "num_examples": 5}
    wrapped = indices(it.next_batch(7))  # epoch 1 in full, then 2 of epoch 2
    assert sorted(wrapped[:5]) == [0, 1, 2, 3, 4]
    assert it.state() == {"seed": 3, "epoch": 2, "position": 2, "num_examples": 5}

    again = data.PromptIterator(examples, seed=3)
    assert indices(again.next_batch(12)) == first_epoch + wrapped
    other_seed = data.PromptIterator(examples, seed=4)
    assert [indices(other_seed.next_batch(5)) for _ in range(3)] != [
        indices(data.PromptIterator(examples, seed=3).next_batch(5)) for _ in range(3)
    ]

    saved = it.state()
    expected_next = [indices(it.next_batch(4)) for _ in range(3)]
    resumed = data.PromptIterator(examples, seed=0)
    resumed.restore({k: np.int64(v) for k, v in saved.items()})  # as read from a checkpoint
    assert [indices(resumed.next_batch(4)) for _ in range(3)] == expected_next
    with pytest.raises(ValueError, match="5 examples"):
        data.PromptIterator(examples[:4]).restore(saved)


def test_pad_prompts_left_to_a_fixed_length():
    tokens, mask = data.pad_prompts([[5, 6, 7], [8], []], length=4, pad_id=0)
    np.testing.assert_array_equal(tokens, [[0, 5, 6, 7], [0, 0, 0, 8], [0, 0, 0, 0]])
    np.testing.assert_array_equal(
        mask, [[False, True, True, True], [False, False, False, True], [False, False, False, False]]
    )
    assert tokens.dtype == np.int32 and mask.dtype == bool
    tokens, _ = data.pad_prompts([[1] * 5], length=8, pad_id=9)
    assert tokens.shape == (1, 8) and list(tokens[0, :3]) == [9, 9, 9]
    with pytest.raises(ValueError, match="9 tokens is longer than 8"):
        data.pad_prompts([[1] * 9], length=8, pad_id=0)

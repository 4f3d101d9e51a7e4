"""Every config value, data file and workdir is checked before compilation, as one line."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from configs import dapo
from dapo_jax import config_checks, data, overrides
from dapo_jax.errors import ConfigError, DataFileError


@pytest.mark.parametrize("variant", sorted(dapo.VARIANTS))
def test_shipped_configs_are_in_range(variant):
    config_checks.check_ranges(dapo.get_config(variant))


@pytest.mark.parametrize(
    "key,value,message",
    [
        ("train.steps", -3, "train.steps must be an int in [1, inf), got -3"),
        ("train.steps", 0, "train.steps must be an int in [1, inf), got 0"),
        ("loss.eps_low", -0.5, "loss.eps_low must be a float in [0, 1), got -0.5"),
        ("loss.eps_low", 1.0, "loss.eps_low must be a float in [0, 1), got 1.0"),
        ("loss.eps_high", -0.1, "loss.eps_high must be a float in [0, inf), got -0.1"),
        ("rollout.group_size", 0, "rollout.group_size must be an int in [1, inf), got 0"),
        ("optim.lr", 0.0, "optim.lr must be a float in (0, inf), got 0.0"),
        ("optim.lr", -1e-6, "optim.lr must be a float in (0, inf), got -1e-06"),
        ("optim.schedule", "linear", "optim.schedule must be one of ('constant', 'cosine'), got 'linear'"),
        ("rollout.max_new_tokens", 0, "rollout.max_new_tokens must be an int in [1, inf), got 0"),
        ("data.max_prompt_len", 0, "data.max_prompt_len must be an int in [1, inf), got 0"),
        ("rollout.top_p", 0.0, "rollout.top_p must be a float in (0, 1], got 0.0"),
        ("rollout.temperature", 0.0, "rollout.temperature must be a float in (0, inf), got 0.0"),
        ("checkpoint.every", 0, "checkpoint.every must be an int in [1, inf), got 0"),
        ("train.micro_batch_size", 0, "train.micro_batch_size must be an int in [1, inf), got 0"),
        (
            "filter.max_num_gen_batches",
            0,
            "filter.max_num_gen_batches must be an int in [1, inf) or None (no bound), got 0",
        ),
        ("reward.overlong_buffer", 200, "reward.overlong_buffer 200 exceeds rollout.max_new_tokens 96"),
        ("loss.clip_ratio_c", 0.5, "loss.clip_ratio_c must be a float in (1, inf) or None (off), got 0.5"),
        ("data.prompt_buckets", (0,), "data.prompt_buckets must be positive lengths, got (0,)"),
        (
            "filter.metric",
            "length",
            "filter.metric must be one of ('acc', 'score', 'reward'), got 'length'",
        ),
        (
            "filter.on_exhausted",
            "crash",
            "filter.on_exhausted must be one of ('mask', 'raise'), got 'crash'",
        ),
        (  # a policy factory: no policy by its name alone
            "model.remat",
            "save_only_these_names",
            "model.remat must be one of ('nothing_saveable', 'dots_with_no_batch_dims_saveable', "
            "'dots_saveable', 'everything_saveable') or None (off), got 'save_only_these_names'",
        ),
        (
            "reward.fn",
            "math",
            "config.reward: unknown reward fn 'math'; valid names: "
            "['last_number', 'math_dapo', 'math_verify'], or 'module:function', or "
            "'path/to/file.py:function'",
        ),
    ],
)
def test_out_of_range_value_is_named(key, value, message):
    c = overrides.apply(dapo.get_config("tiny"), {key: value})
    with pytest.raises(ConfigError) as e:
        config_checks.check_config(c)
    assert str(e.value) == message


@pytest.mark.parametrize(
    "settings,message",
    [
        (
            {"loss.old_logp": "cached"},
            "loss.old_logp must be one of ('recompute', 'sampler', 'detached'), got 'cached'",
        ),
        (
            {"loss.old_logp": "detached"},  # tiny: 32 prompts in mini-batches of 8
            "loss.old_logp 'detached' needs one update per rollout batch (train.mini_batch_prompts "
            "= train.train_batch_prompts), got 4 updates: use 'recompute' or 'sampler'",
        ),
        (
            {"loss.old_logp": "sampler", "filter.carry_over": True},
            "loss.old_logp 'sampler' with filter.carry_over: carried groups were sampled before the "
            "last update, so pi_old of them must be recomputed: use loss.old_logp 'recompute'",
        ),
        (
            {"loss.old_logp": "sampler", "rollout.param_dtype": "bfloat16"},
            "loss.old_logp 'sampler' with rollout.param_dtype 'bfloat16': the sampler's log-probs are "
            "not pi_old of the trainer's float32 model: use 'recompute' or 'detached'",
        ),
        (
            {"loss.old_logp": "sampler", "rollout.dtype": "bfloat16"},
            "loss.old_logp 'sampler' with rollout.dtype 'bfloat16': the sampler's log-probs are "
            "not pi_old of the trainer's float32 model: use 'recompute' or 'detached'",
        ),
        (
            {"loss.old_logp": "sampler", "loss.rollout_is": "token"},
            "loss.rollout_is / rollout_rs with loss.old_logp 'sampler': the correction weighs "
            "pi_old / pi_sampler, 1 when pi_old is the sampler's: use loss.old_logp 'recompute'",
        ),
        (
            {"loss.rollout_rs": "tokens"},
            "loss.rollout_rs must be one of ('token', 'sequence', 'geometric') or None (off), got 'tokens'",
        ),
        (
            {"rollout.param_dtype": "int8"},
            "rollout.param_dtype must be one of ('float32', 'bfloat16') or None (model.param_dtype), "
            "got 'int8'",
        ),
        (
            {"rollout.dtype": "float16"},
            "rollout.dtype must be one of ('float32', 'bfloat16') or None (model.dtype), got 'float16'",
        ),
    ],
)
def test_old_logp_without_a_recompute_must_be_exact(settings, message):
    c = overrides.apply(dapo.get_config("tiny"), settings)
    with pytest.raises(ConfigError) as e:
        config_checks.check_config(c)
    assert str(e.value) == message
    one_update = {"loss.old_logp": "detached", "train.mini_batch_prompts": 32, "train.micro_batch_size": 64}
    config_checks.check_config(overrides.apply(dapo.get_config("tiny"), one_update))


def _bad_files(tmp):
    not_parquet = tmp / "notes.parquet"
    not_parquet.write_text("a,b\n1,2\n")
    empty_parquet = tmp / "empty.parquet"
    pq.write_table(pa.table({"prompt": pa.array([], pa.string())}), empty_parquet)
    empty_jsonl = tmp / "empty.jsonl"
    empty_jsonl.write_text("\n  \n")
    csv = tmp / "train.csv"
    csv.write_text("a,b\n")
    return [
        (not_parquet, "is not a readable parquet file"),
        (empty_parquet, "has no rows"),
        (empty_jsonl, "has no rows"),
        (csv, "expected a .parquet or .jsonl file"),
        (tmp, "is a directory"),
        (tmp / "nowhere.jsonl", "does not exist"),
    ]


def test_bad_data_files_are_named(tmp_path):
    for path, problem in _bad_files(tmp_path):
        c = dapo.get_config("tiny")
        c.data.eval_files = (str(path),)
        with pytest.raises(DataFileError) as e:
            config_checks.check_config(c)
        text = str(e.value)
        assert text.startswith(f"data file {str(path)!r}") and problem in text, text
        assert "\n" not in text


def test_file_without_usable_rows_is_named(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"prompt": "not a list"}) + "\nnot json\n")
    data.check_data_file(str(path))  # it has lines: only loading it finds them unusable
    with pytest.raises(
        DataFileError,
        match=f"^data file '{path}' has no usable rows "
        r"\(2 rows, 2 malformed\)$",
    ):
        data.load_prompts(str(path), None, 8)


def test_workdir_that_is_a_file_is_named(tmp_path):
    f = tmp_path / "run"
    f.write_text("")
    for workdir in (f, f / "sub"):
        with pytest.raises(ConfigError, match=f"^workdir '{workdir}': '{f}' is a file, not a folder$"):
            config_checks.check_workdir(str(workdir))
    config_checks.check_workdir(str(tmp_path / "new" / "run"))  # a folder still to create is fine
    config_checks.check_workdir(str(tmp_path))

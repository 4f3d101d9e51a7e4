"""Every key of every config carries its schema (`dapo_jax.config_schema`), and a value outside
it is a one-line ConfigError naming the key, what it takes and the value."""

import copy
import os
import subprocess
import sys

import pytest
from absl import flags
from ml_collections import config_flags

from configs import ablation, common, dapo, grpo
from dapo_jax import config_schema, export, overrides
from dapo_jax.config_schema import Field, Spec
from dapo_jax.errors import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize(
    "value,interval,inside",
    [
        (0, "[0, 1)", True),
        (1, "[0, 1)", False),
        (-0.5, "[0, 1)", False),
        (0.999, "[0, 1)", True),
        (0, "(0, inf)", False),
        (1e-9, "(0, inf)", True),
        (1, "(0, 1]", True),
        (1.5, "(0, 1]", False),
        (10**9, "[1, inf)", True),
    ],
)
def test_in_interval(value, interval, inside):
    assert config_schema.in_interval(value, interval) is inside


def _all_configs():
    for v in sorted(dapo.VARIANTS):
        yield dapo.get_config(v)
        yield grpo.get_config(v)
        yield from (ablation.get_config(f"{row},{v}") for row in ablation.ROW_NAMES)


def test_every_key_of_every_config_has_a_schema_and_passes_it():
    for c in _all_configs():
        leaves = dict(config_schema.fields(c))
        assert all(isinstance(f, Field) for f in leaves.values()), [k for k, f in leaves.items()]
        config_schema.check(c)
    assert len(leaves) == 84  # the keys of a config, one schema each


@pytest.mark.parametrize(
    "spec,value,message",
    [
        (Spec(int, "[1, inf)"), 0, "k must be an int in [1, inf), got 0"),
        (Spec(int, "[1, inf)"), 2.0, "k must be an int in [1, inf), got 2.0"),
        (Spec(int, "[1, inf)"), True, "k must be an int in [1, inf), got True"),
        (
            Spec(int, "[1, inf)"),
            None,
            "k must be an int in [1, inf), got None; None is not allowed: set a value",
        ),
        (Spec(float, "(0, 1]"), 1.5, "k must be a float in (0, 1], got 1.5"),
        (Spec(float, "(0, 1]"), "1", "k must be a float in (0, 1], got '1'"),
        (Spec(str, choices=("a", "b")), "c", "k must be one of ('a', 'b'), got 'c'"),
        (Spec(bool), 1, "k must be a bool, got 1"),
        (Spec(tuple), "x.parquet", "k must be a tuple, got 'x.parquet'"),
    ],
)
def test_a_value_outside_its_spec_is_named(spec, value, message):
    field = Field(spec, 1 if spec.kind is int else None)
    assert config_schema.problem("k", field, value) == message


@pytest.mark.parametrize(
    "spec,value", [(Spec(int, "[1, inf)"), 1), (Spec(float, "(0, 1]"), 1), (Spec(float, "(0, 1]"), 1.0)]
)
def test_a_value_inside_its_spec_passes(spec, value):
    assert config_schema.problem("k", Field(spec, value), value) is None


def test_a_section_names_missing_and_unknown_keys():
    with pytest.raises(TypeError, match=r"unknown keys \['stepz'\], missing keys \['steps'\]"):
        common.train(
            stepz=1,
            train_batch_prompts=1,
            mini_batch_prompts=1,
            micro_batch_size=1,
            max_consecutive_nonfinite=1,
        )


def test_overrides_and_copies_keep_the_schema():
    c = overrides.apply(dapo.get_config("tiny"), {"train.steps": 0, "loss.eps_low": 0})
    assert c.loss.eps_low == 0.0 and isinstance(c.loss.eps_low, float)  # an int set on a float key
    for config in (c, copy.deepcopy(c), export.without_train_data(c)):
        with pytest.raises(ConfigError, match=r"^train.steps must be an int in \[1, inf\), got 0$"):
            config_schema.check(config)


def test_a_section_replaced_by_a_plain_dict_is_named():
    c = dapo.get_config("tiny")
    c.mesh = dict(data=-1, fsdp=1, tensor=1)
    message = r"^mesh.data has no schema: build its section with configs/common.py$"
    with pytest.raises(ConfigError, match=message):
        config_schema.check(c)


# The keys that take None, and what None means for each (configs/common.py).
NONE_KEYS = {
    "model.tokenizer_path": "model.path's",
    "model.remat": "off",
    "reference.path": "no reference model: β = 0",
    "rollout.top_k": "all tokens",
    "rollout.param_dtype": "model.param_dtype",
    "rollout.dtype": "model.dtype",
    "loss.clip_ratio_c": "off",
    "loss.norm_const": "L_max",
    "loss.rollout_is": "off",
    "loss.rollout_rs": "off",
    "loss.rollout_rs_threshold_lower": "1 / rollout_rs_threshold",
    "filter.max_num_gen_batches": "no bound",
    "checkpoint.every_minutes": "off",
    "eval.every": "none during training",
    "eval.max_problems": "all",
    "metrics.completions_every": "none",
    "metrics.completions_chars": "all",
}


@pytest.mark.parametrize("variant", sorted(dapo.VARIANTS))
def test_exactly_the_off_keys_take_none(variant):
    leaves = dict(config_schema.fields(dapo.get_config(variant)))
    assert {k: f.spec.none for k, f in leaves.items() if f.spec.none} == NONE_KEYS
    c = overrides.apply(dapo.get_config(variant), dict.fromkeys(NONE_KEYS))
    config_schema.check(c)
    with pytest.raises(ConfigError, match=r"^train.steps must be an int in \[1, inf\), got None; None is"):
        config_schema.check(overrides.apply(c, {"train.steps": None}))


def _parse(spec: str, *overrides_: str):
    """The config of `--config=configs/<spec>` and the overrides, through config_flags (lock_config
    as dapo_jax.cli)."""
    argv = ["prog", f"--config={os.path.join(ROOT, 'configs', spec)}", *overrides_]
    values = flags.FlagValues()
    config_flags.DEFINE_config_file("config", None, "", values, lock_config=True, sys_argv=argv)
    values(argv)
    return values.config


def test_the_command_line_sets_a_value_or_none():
    c = _parse("dapo.py:qwen2_5_32b", "--config.checkpoint.every_minutes=None", "--config.rollout.top_k=40")
    assert c.checkpoint.every_minutes is None and c.rollout.top_k == 40
    c = _parse(
        "dapo.py:qwen2_5_32b",
        "--config.checkpoint.every_minutes=20",
        "--config.model.tokenizer_path=/tokenizers/qwen",
        "--config.loss.rollout_is=token",
        "--config.rollout.dtype=float32",
        "--config.filter.max_num_gen_batches=None",
    )
    assert c.checkpoint.every_minutes == 20.0 and isinstance(c.checkpoint.every_minutes, float)
    assert (c.model.tokenizer_path, c.rollout.dtype) == ("/tokenizers/qwen", "float32")
    assert c.loss.rollout_is == "token"
    assert c.filter.max_num_gen_batches is None
    config_schema.check(c)
    c = _parse("ablation.py:soft_overlong,tiny", "--config.eval.every=None", "--config.loss.norm_const=64")
    assert c.eval.every is None and c.loss.norm_const == 64
    c = _parse("dapo.py:tiny", "--config.checkpoint.every_minutes=-5", "--config.rollout.top_k=0")
    with pytest.raises(ConfigError, match=r"^checkpoint.every_minutes must be a float in \(0, inf\) or None"):
        config_schema.check(c)


@pytest.mark.slow
def test_none_on_a_key_without_it_is_one_line(tmp_path):
    cmd = [sys.executable, "-m", "dapo_jax.train", "--config=configs/dapo.py:tiny", f"--workdir={tmp_path}"]
    done = subprocess.run([*cmd, "--config.train.steps=None"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == (
        "error: --config.train.steps: train.steps must be an int in [1, inf), got None; "
        "None is not allowed: set a value"
    )

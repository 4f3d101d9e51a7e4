"""Every key of every config carries its schema (`dapo_jax.config_schema`), and a value outside
it is a one-line ConfigError naming the key, what it takes and the value."""

import copy

import pytest

from configs import ablation, common, dapo, grpo
from dapo_jax import config_schema, export, overrides
from dapo_jax.config_schema import Field, Spec
from dapo_jax.errors import ConfigError


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
    assert len(leaves) == 100  # the keys of a config, one schema each


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
            length_bucket=1,
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

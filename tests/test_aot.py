"""The AOT tool on the tiny config over fake CPU devices: every program compiles and fits, and a
memory too small for them is rejected with one line."""

import json
import os
import subprocess
import sys

import pytest

from configs import dapo
from dapo_jax import aot, aot_report, chips, dapo_lengths, overrides
from dapo_jax.errors import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _aot(*flags):
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    return subprocess.run(
        [sys.executable, "-m", "dapo_jax.aot", "--config=configs/dapo.py:tiny", "--topology=cpu:8", *flags],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.slow
def test_tiny_programs_compile_and_fit():
    """The run's programs as `programs.build` makes them, the rollout on a tensor-parallel bf16
    mesh of its own: each compiles, fits, and counts the train state resident beside it."""
    out = _aot("--config.mesh.tensor=2", "--config.rollout.param_dtype=bfloat16")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "rollout mesh {'data': 4, 'fsdp': 1, 'tensor': 2} in bfloat16" in out.stdout
    rows = json.loads(out.stdout.strip().splitlines()[-1])
    assert [r["program"] for r in rows] == ["train", "logprobs", "rollout", "eval", "cast", "decode"]
    by_name = {r["program"]: r for r in rows}
    for r in rows[:4]:
        assert 0 < r["total_gib"] < r["hbm_gib"] == 16
        assert r["tflops_per_chip"] > 0 and r["temp_gib"] > 0
    assert by_name["train"]["alias_gib"] > 0  # the donated state: its outputs alias its arguments
    assert by_name["train"]["resident_gib"] == 0  # the state is the train step's own argument
    # beside the log-prob pass (the params its argument): the two AdamW moments, as large as the
    # f32 params; beside a sampler: the whole state, params too, besides its bf16 copy
    logprobs, rollout = by_name["logprobs"], by_name["rollout"]
    assert logprobs["resident_gib"] == pytest.approx(2 * logprobs["args_gib"], rel=0.05)
    assert rollout["resident_gib"] == pytest.approx(1.5 * logprobs["resident_gib"], rel=1e-3)
    assert by_name["cast"]["out_gib"] == pytest.approx(by_name["cast"]["args_gib"] / 2, rel=1e-3)
    layouts = {r["layout"]: r for r in rows[5]["layouts"]}
    assert set(layouts) == {"trainer FSDP", "rollout TP"}
    assert all(r["hbm_bytes_per_token"] > 0 and r["kv_cache_gib"] > 0 for r in layouts.values())


@pytest.mark.slow
def test_packed_programs_compile_fit_and_count_fewer_flops():
    out = _aot("--programs=train,train_packed,logprobs,logprobs_packed")
    assert out.returncode == 0, out.stderr[-2000:]
    rows = {r["program"]: r for r in json.loads(out.stdout.strip().splitlines()[-1])}
    for name in ("train", "logprobs"):  # the synthetic DAPO-shaped batch packs into fewer rows
        assert 0 < rows[name + "_packed"]["total_gib"] < 16
        assert rows[name + "_packed"]["tflops_per_chip"] < rows[name]["tflops_per_chip"] / 2


def test_dapo_lengths_have_the_recipe_shape():
    length_B = dapo_lengths.dapo_lengths(8192, 2048, 20480)  # prompt (128-256 tokens) + response
    assert 0.035 < (length_B > 20480).mean() < 0.05  # ~4% of the responses at L_max
    assert 4000 < length_B.mean() < 4600  # a mean response of ~4k tokens, plus ~190 of prompt


@pytest.mark.slow
def test_too_small_memory_is_one_line():
    out = _aot("--hbm_gib=0.001", "--programs=logprobs")
    assert out.returncode == 1
    (line,) = out.stderr.strip().splitlines()[-1:]
    assert line.startswith("does not fit: logprobs needs ") and "0.001 GiB" in line
    assert "Traceback" not in out.stderr


def test_bad_topology_is_named():
    with pytest.raises(ConfigError, match="v7x-8"):
        chips.topology_devices("v7x-8")
    assert chips._torus(64, 3, "v5p-128") == (4, 4, 4)
    assert chips._torus(256, 2, "v6e-256") == (16, 16)
    assert chips._torus(128, 3, "v5p-256") == (4, 4, 8)


def test_batch_sizes_are_checked_against_the_slice_before_compiling():
    c = overrides.apply(dapo.get_config("tiny"), {"train.micro_batch_size": 24})
    with pytest.raises(ConfigError, match=r"^train.micro_batch_size 24: .* over the 8 devices .* 16 and 32$"):
        aot.analyse(c, "cpu:8", None, ["train"])


def test_a_program_the_compiler_could_not_fit_is_the_complaint():
    """A program whose compile ran out of HBM (the row `aot_engine.engine_rows` makes of the compiler's
    RESOURCE_EXHAUSTED) is named with the compiler's line, before a later row that does not fit."""
    rows = [
        dict(program="engine", total_gib=float("inf"), hbm_gib=95, error="RESOURCE_EXHAUSTED: 97.60G"),
        dict(program="eval", total_gib=100.0, hbm_gib=95),
    ]
    assert aot_report.check_fit(rows) == "engine: RESOURCE_EXHAUSTED: 97.60G"
    assert aot_report.check_fit(rows[1:]).startswith("eval needs 100.00 GiB per chip, 5.00 GiB more")

"""Every size key against the device count: the sampler's counts are padded exactly (odd prompts,
odd n, odd micro-batches give one device's rows; evaluation at --samples 1, 3, 5 on 2 devices gives
1 device's avg@n), the trainer's fail before compiling in one line naming the key, the value, the
devices and the nearest values that work."""

import dataclasses
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from test_sampler import _config, _load, _prompts

from configs import ablation, dapo, grpo
from dapo_jax import config_checks, metrics, overrides, sampler, sharding, sizes, train
from dapo_jax.errors import ConfigError

from conftest import small

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
UIDS = [4, 1, 7, 2, 9]
OVER_2 = "the 2 devices of the mesh's data x fsdp axes"


@pytest.mark.parametrize(
    "count,devices,want",
    [(125, 2, 126), (126, 2, 126), (6, 4, 8), (3, 8, 8), (8, 8, 8), (1, 1, 1), (0, 2, 0)],
)
def test_padded_count_by_hand(count, devices, want):
    assert sizes.padded_count(count, devices) == want


def test_pad_rows_and_nearest_by_hand():
    np.testing.assert_array_equal(
        sizes.pad_rows(np.array([[1, 2], [3, 4]]), 4), [[1, 2], [3, 4], [3, 4], [3, 4]]
    )
    np.testing.assert_array_equal(sizes.pad_rows(np.array([5, 6]), 2), [5, 6])
    assert sizes.nearest(24, lambda v: 64 % v == 0 and v % 2 == 0, 64) == (16, 32)
    assert sizes.nearest(1, lambda v: v % 2 == 0, 5) == (2,)
    assert sizes.nearest(70, lambda v: 64 % v == 0, 64) == (64,)


@pytest.mark.parametrize(
    "settings,message",
    [
        (
            {"train.train_batch_prompts": 5, "rollout.group_size": 3, "train.mini_batch_prompts": 5},
            f"train.train_batch_prompts 5: 5 prompts x G=3 = 15 rows do not split over {OVER_2}; "
            "nearest values that work: 4 and 6",
        ),
        (
            {"train.mini_batch_prompts": 5},
            "train.mini_batch_prompts 5: a train batch of 32 prompts splits into mini-batches of 1, 2, 4, "
            f"8, 16 or 32 prompts, whose rows (x G=8) split over {OVER_2}; nearest values that work: 4 and 8",
        ),
        (
            {"train.mini_batch_prompts": 1, "rollout.group_size": 3},
            "train.mini_batch_prompts 1: a train batch of 32 prompts splits into mini-batches of 2, 4, 8, "
            f"16 or 32 prompts, whose rows (x G=3) split over {OVER_2}; nearest value that works: 2",
        ),
        (
            {"train.micro_batch_size": 24},
            "train.micro_batch_size 24: a mini-batch of 8 prompts x G=8 = 64 rows splits into micro-batches "
            f"of 2, 4, 8, 16, 32 or 64 rows, each split over {OVER_2}; nearest values that work: 16 and 32",
        ),
        (  # an odd G is no error of its own: the rows it makes meet the micro-batches
            {"rollout.group_size": 3},
            "train.micro_batch_size 16: a mini-batch of 8 prompts x G=3 = 24 rows splits into micro-batches "
            f"of 2, 4, 6, 8, 12 or 24 rows, each split over {OVER_2}; nearest values that work: 12 and 24",
        ),
        (
            {"train.micro_batch_size": 1},
            "train.micro_batch_size 1: a mini-batch of 8 prompts x G=8 = 64 rows splits into micro-batches "
            f"of 2, 4, 8, 16, 32 or 64 rows, each split over {OVER_2}; nearest value that works: 2",
        ),
    ],
)
def test_the_trainers_sizes_are_one_line_naming_the_key(settings, message):
    c = overrides.apply(dapo.get_config("tiny"), settings)
    with pytest.raises(ConfigError) as e:
        config_checks.check_config(c, num_devices=2)
    assert str(e.value) == message
    config_checks.check_config(dapo.get_config("tiny"), num_devices=2)


def test_the_mesh_is_checked_against_the_devices():
    with pytest.raises(ConfigError, match=r"^mesh \{'data': 3, 'fsdp': 1, 'tensor': 1\} needs 3 devices"):
        config_checks.check_config(overrides.apply(dapo.get_config("tiny"), {"mesh.data": 3}), num_devices=8)


@pytest.mark.parametrize(
    "config,devices",
    [
        (dapo.get_config("tiny"), 2),
        (dapo.get_config("tiny"), 8),
        (grpo.get_config("tiny"), 2),
        (ablation.get_config("dynamic_sampling,tiny"), 2),
        (dapo.get_config("qwen2_5_7b"), 32),
        (dapo.get_config("qwen3_8b"), 32),
        (dapo.get_config("qwen2_5_32b"), 64),
    ],
)
def test_the_shipped_configs_fit_their_slices(config, devices):
    axes = sizes.check_batch_sizes(config, devices)
    assert axes.devices == devices and devices % axes.rows == 0


def test_a_slice_too_wide_for_the_micro_batches_names_them():
    """The 32B config on 512 chips: fsdp 64, where a micro-batch of 16 rows is a quarter row a chip."""
    message = r"^train.micro_batch_size 16: .* 512 rows .* of 64, 128, 256 or 512 rows.* works: 64$"
    with pytest.raises(ConfigError, match=message):
        sizes.check_batch_sizes(dapo.get_config("qwen2_5_32b"), 512)


@pytest.fixture(scope="module")
def one_device_rows(qwen2_dir):
    """One device's rows of 5 prompts x n = 3: the reference every mesh must give."""
    single = sharding.make_mesh({"data": -1}, devices=jax.devices()[:1])
    m, params = _load(qwen2_dir, single)
    prompt, mask = _prompts([8, 3, 6, 1, 5], 8, seed=11)
    cfg = _config(eos_ids=tuple(range(3, 11)), temperature=0.8)
    out = sampler.Sampler(m, cfg, single).generate(params, prompt, mask, 3, jax.random.key(2), uids_P=UIDS)
    return prompt, mask, cfg, jax.device_get(out)


@pytest.mark.parametrize(
    "mesh_sizes,micro,slots,paged",
    [
        ({"data": 2}, None, None, False),  # a loop per device: 5 prompts filled to 6
        # rollout micro-batches of 3 + 2 prompts, each filled to 4 and 2
        pytest.param({"data": 2}, 3, None, False, marks=pytest.mark.slow),
        pytest.param({"data": 2}, None, 2, True, marks=pytest.mark.slow),  # the engine, a slot a shard
        # one loop over a data x tensor mesh: 5 prompts filled to 6
        pytest.param({"data": 2, "tensor": 2}, None, None, False, marks=pytest.mark.slow),
    ],
)
def test_odd_prompts_and_samples_are_padded_exactly(
    qwen2_dir, one_device_rows, mesh_sizes, micro, slots, paged
):
    """filter.gen_batch_prompts, rollout.group_size, rollout.micro_batch_prompts and
    rollout.decode_slots need not divide the devices: 5 prompts x n = 3 on 2 data devices give
    one device's rows, none of the fill's."""
    prompt, mask, cfg, ref = one_device_rows
    mesh = sharding.make_mesh(mesh_sizes, devices=jax.devices()[: 2 * mesh_sizes.get("tensor", 1)])
    m, params = _load(qwen2_dir, mesh)
    cfg = dataclasses.replace(cfg, decode_slots=slots, paged=paged, page_size=4)
    s = sampler.Sampler(m, cfg, mesh, micro_batch_prompts=micro)
    out = jax.device_get(s.generate(params, prompt, mask, 3, jax.random.key(2), uids_P=UIDS))
    assert out.tokens_BxN.shape == ref.tokens_BxN.shape == (15, 10)
    for k in ("tokens_BxN", "length_B", "truncated_B", "mask_BxN"):
        np.testing.assert_array_equal(getattr(out, k), getattr(ref, k), err_msg=k)
    np.testing.assert_allclose(out.logp_BxN, ref.logp_BxN, atol=1e-5)


# Evaluates the tiny model on 5 problems in chunks of 3 (3 + 2: eval.max_problems and
# eval.batch_prompts odd too) at --samples 1, 3 and 5, through the function the CLI calls.
_EVALUATE = """
import json, sys
from configs import dapo
from dapo_jax import evaluate, overrides
c = overrides.apply(dapo.get_config("tiny"), {"eval.max_problems": 5, "eval.batch_prompts": 3,
                                              "reward.num_workers": 1})
out = {}
for n in (1, 3, 5):
    config = evaluate.apply_overrides(c, samples=n, max_new_tokens=24)
    result, folder = evaluate.evaluate(config, model="assets/tiny-qwen2", out=f"{sys.argv[1]}/{n}")
    rows = [json.loads(line) for line in open(f"{folder}/samples.jsonl")]
    out[n] = {"avg": result[f"eval/avg@{n}"], "problems": result["eval/num_problems"], "rows": rows}
print("RESULT " + json.dumps(out))
"""


def _evaluate_on(devices: int, out) -> dict:
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
    done = subprocess.run(
        [sys.executable, "-c", _EVALUATE, str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
    return {int(n): r for n, r in json.loads(line[len("RESULT ") :]).items()}


@pytest.mark.slow
def test_evaluate_takes_any_samples_on_two_devices_as_on_one(tmp_path):
    """`python -m dapo_jax.evaluate --samples` 1, 3 and 5 on the tiny model over 2 devices (the
    issue's traceback: P*n rows that do not divide): each runs, writes 5 x n samples, and its avg@n
    and every response equal one device's; avg@n is the mean of its rows' acc by problem."""
    two, one = _evaluate_on(2, tmp_path / "two"), _evaluate_on(1, tmp_path / "one")
    for n in (1, 3, 5):
        assert two[n]["problems"] == 5 and len(two[n]["rows"]) == 5 * n
        assert two[n]["avg"] == one[n]["avg"]
        pick = lambda rows: [(r["problem_id"], r["sample"], r["response"], r["acc"]) for r in rows]
        assert pick(two[n]["rows"]) == pick(one[n]["rows"])
        by_problem = {}
        for r in two[n]["rows"]:
            by_problem.setdefault(r["problem_id"], []).append(r["acc"])
        assert two[n]["avg"] == pytest.approx(np.mean([np.mean(a) for a in by_problem.values()]))


@pytest.mark.slow
def test_a_run_takes_odd_generation_and_evaluation_batches(tmp_path):
    """One tiny step on the 8 test devices with generation batches of 3 prompts x G=4 = 12 rows
    and a held-out evaluation of 5 problems x 3 samples in chunks of 3: the step trains on 4
    groups and the evaluation counts 5 problems."""
    c = small(
        dapo.get_config("tiny"),
        filter__gen_batch_prompts=3,
        filter__max_num_gen_batches=4,
        eval__max_problems=5,
        eval__samples=3,
        eval__batch_prompts=3,
        eval__every=1,
    )
    summary = train.train(c, str(tmp_path))
    assert summary["actor/skipped_updates"] == 0 and summary["actor/grad_norm"] > 0
    assert summary["dynamic_sampling/prompts_consumed"] == 3 * summary["dynamic_sampling/gen_batches"]
    assert 0 <= summary["eval/avg@3"] <= 1 and summary["eval/pass@3"] >= summary["eval/avg@3"]
    assert [r["step"] for r in metrics.read_jsonl(str(tmp_path / metrics.JSONL))] == [1]

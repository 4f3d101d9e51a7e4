"""The training run end to end: resume after SIGKILL equals an uninterrupted run, SIGTERM saves,
bad configs fail in one line before compiling, and non-finite updates are skipped and stop the run."""

import dataclasses
import logging
import math
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from configs import dapo
from dapo_jax import assembly, checkpoint, metrics, rollout, step_metrics, train, train_step
from dapo_jax.records import TrainBatch

from conftest import WALL_CLOCK, small, small_flags
from test_dynamic_sampling import gen_batch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cli(workdir, *extra):
    return [
        sys.executable,
        "-m",
        "dapo_jax.train",
        "--config=configs/dapo.py:tiny",
        f"--workdir={workdir}",
        *extra,
    ]


def _start(workdir, *extra):
    return subprocess.Popen(
        _cli(workdir, *extra), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def _wait_for_step(proc, workdir, step, timeout=600):
    path = os.path.join(workdir, metrics.JSONL)
    deadline = time.time() + timeout
    while time.time() < deadline:
        if os.path.exists(path) and any(r["step"] >= step for r in metrics.read_jsonl(path)):
            return
        if proc.poll() is not None:
            raise AssertionError(f"run ended early:\n{proc.stdout.read()[-3000:]}")
        time.sleep(0.2)
    raise AssertionError(f"no step {step} within {timeout} s")


def _maths(records):
    return {r["step"]: {k: v for k, v in r.items() if not k.startswith(WALL_CLOCK)} for r in records}


@pytest.mark.slow
def test_resume_after_sigkill_and_sigterm_equals_uninterrupted_run(tmp_path):
    flags = small_flags(train__steps=4, filter__carry_over=True)
    reference, interrupted = str(tmp_path / "reference"), str(tmp_path / "interrupted")

    proc = _start(reference, *flags)
    assert proc.wait(timeout=900) == 0, proc.stdout.read()[-3000:]

    proc = _start(interrupted, *flags)
    _wait_for_step(proc, interrupted, 2)
    proc.send_signal(signal.SIGKILL)  # no chance to save: the run resumes from its last checkpoint
    proc.wait()
    proc = _start(interrupted, *flags)
    _wait_for_step(proc, interrupted, 3)
    proc.send_signal(signal.SIGTERM)  # preemption: abandon the step in flight, exit "requeue me"
    assert proc.wait(timeout=60) == train.PREEMPTED == 75
    saved = checkpoint.Checkpointer(interrupted).latest_step()  # its metrics' step or the one before
    logged = max(r["step"] for r in metrics.read_jsonl(os.path.join(interrupted, metrics.JSONL)))
    assert saved in (logged - 1, logged)
    proc = _start(interrupted, *flags)
    assert proc.wait(timeout=900) == 0, proc.stdout.read()[-3000:]

    expected = _maths(metrics.read_jsonl(os.path.join(reference, metrics.JSONL)))
    got = _maths(metrics.read_jsonl(os.path.join(interrupted, metrics.JSONL)))
    assert sorted(got) == sorted(expected) == [1, 2, 3, 4]  # no step missing or repeated
    for step in expected:
        assert got[step].keys() == expected[step].keys()
        for key, value in expected[step].items():
            assert got[step][key] == pytest.approx(value, rel=1e-5, abs=1e-7), (step, key)


@pytest.mark.slow
@pytest.mark.parametrize(
    "flag,message",
    [
        ("--config.optim.lrr=1e-6", "config.optim has no key 'lrr'; valid keys: ['b1', 'b2',"),
        (
            "--config.data.train_files=('/no/such/train.parquet',)",
            "data file '/no/such/train.parquet' does not exist",
        ),
        ("--config.model.path=/no/such/model", "'/no/such/model/config.json' does not exist"),
        ("--config.train.steps=-3", "train.steps must be an int in [1, inf), got -3"),
        (  # the tests' 8 devices
            "--config.train.micro_batch_size=24",
            "train.micro_batch_size 24: a mini-batch of 8 prompts x G=8 = 64 rows splits into micro-batches "
            "of 8, 16, 32 or 64 rows, each split over the 8 devices of the mesh's data x fsdp axes; "
            "nearest values that work: 16 and 32",
        ),
        (
            "--config.data.train_files=('{tmp}/a b.parquet',)",
            "data file '{tmp}/a b.parquet' is not a readable parquet file",
        ),
    ],
)
def test_bad_config_is_one_line_before_compiling(flag, message, tmp_path):
    (tmp_path / "a b.parquet").write_text("not parquet")
    flag, message = flag.format(tmp=tmp_path), message.format(tmp=tmp_path)
    out = subprocess.run(
        _cli(str(tmp_path / "run"), flag), cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    lines = [l for l in out.stderr.splitlines() if l[:1] not in "WI" or l.startswith("error")]
    assert out.returncode == 2
    assert lines == [lines[-1]] and lines[-1].startswith("error: ") and message in lines[-1]
    assert not os.path.exists(tmp_path / "run" / "checkpoints")


@pytest.mark.slow
def test_a_damaged_latest_checkpoint_is_skipped_and_every_step_logged_once(tmp_path, capsys, caplog):
    config = small(dapo.get_config("tiny"), train__steps=2)
    workdir = str(tmp_path)
    train.train(config, workdir)
    assert checkpoint.Checkpointer(workdir).all_steps() == [1, 2]
    for root, _, files in os.walk(os.path.join(workdir, "checkpoints", "2")):
        for name in files:  # what a save cut by preemption leaves: every file cut in half
            path = os.path.join(root, name)
            os.truncate(path, os.path.getsize(path) // 2)
    capsys.readouterr()
    with caplog.at_level(logging.WARNING):
        train.train(config, workdir)
    assert "at step 1" in capsys.readouterr().out
    assert any(
        r.getMessage().startswith("checkpoint 2 in ") and "cannot be restored" in r.getMessage()
        for r in caplog.records
    )
    steps = [r["step"] for r in metrics.read_jsonl(os.path.join(workdir, metrics.JSONL))]
    assert steps == [1, 2]
    assert checkpoint.Checkpointer(workdir).all_steps() == [1, 2]


@pytest.mark.slow
def test_nonfinite_updates_are_skipped_then_the_run_stops_with_a_checkpoint(tmp_path, monkeypatch):
    real = rollout.generation_batch

    def nan_rewards(*args, **kwargs):
        batch = real(*args, **kwargs)
        return dataclasses.replace(batch, reward_B=np.full_like(batch.reward_B, np.nan))

    monkeypatch.setattr(rollout, "generation_batch", nan_rewards)
    config = small(
        dapo.get_config("tiny"), train__steps=3, train__max_consecutive_nonfinite=3, checkpoint__every=10
    )
    with pytest.raises(FloatingPointError, match="step 2: 4 updates in a row"):
        train.train(config, str(tmp_path))
    records = metrics.read_jsonl(str(tmp_path / metrics.JSONL))
    assert [(r["step"], r["actor/skipped_updates"], r["actor/update_norm"]) for r in records] == [
        (1, 2, 0.0),
        (2, 2, 0.0),
    ]
    assert all(r["actor/pg_loss"] == "nan" or math.isnan(float(r["actor/pg_loss"])) for r in records)
    assert checkpoint.Checkpointer(str(tmp_path)).latest_step() == 2  # the last good state


@pytest.mark.slow
def test_bfloat16_runs_end_to_end_with_the_detached_old_logp(tmp_path):
    """Two steps of the tiny config in bf16 compute (sampler, prefill, decode and trainer) with one
    update per rollout batch and pi_old the update's own detached log-probs: the updates are finite
    and applied, r = 1 exactly, and the sampler is checked against the trainer (bf16 rounding)."""
    config = small(
        dapo.get_config("tiny"),
        train__steps=2,
        train__mini_batch_prompts=4,
        train__micro_batch_size=8,
        model__dtype="bfloat16",
        loss__old_logp="detached",
        checkpoint__every=10,
    )
    train.train(config, str(tmp_path))
    records = metrics.read_jsonl(str(tmp_path / metrics.JSONL))
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert r["actor/skipped_updates"] == 0 and r["actor/update_norm"] > 0
        assert r["actor/approx_kl_old"] == 0.0 and r["actor/pg_clipfrac_upper"] == 0.0
        assert 0 < r["rollout/logp_diff_mean"] < 0.1 and r["rollout/logp_diff_max"] < 1.0


@pytest.mark.slow
def test_mismatch_correction_runs_end_to_end_against_a_bf16_sampler(tmp_path):
    """One step with a bf16 sampler and an f32 trainer, token IS and token rejection at a tight
    threshold: the mismatch is measured (rollout_corr/*, verl's names), some tokens are rejected,
    the truncated weights average near 1, and the updates are applied."""
    config = small(
        dapo.get_config("tiny"),
        train__steps=1,
        rollout__dtype="bfloat16",
        loss__rollout_is="token",
        loss__rollout_rs="token",
        loss__rollout_rs_threshold=1.02,
        checkpoint__every=10,
    )
    train.train(config, str(tmp_path))
    (r,) = metrics.read_jsonl(str(tmp_path / metrics.JSONL))
    assert r["actor/skipped_updates"] == 0 and r["actor/update_norm"] > 0
    assert 0 < r["rollout_corr/rollout_rs_masked_fraction"] < 0.5
    assert 0.9 < r["rollout_corr/rollout_is_mean"] < 1.1 and r["rollout_corr/rollout_is_max"] > 1.0
    assert r["rollout_corr/k3_kl"] > 0


def test_logp_agreement_measures_carried_groups_apart():
    """Rows 0-1 (a carried group) were sampled before the last update; rows 2-3 now. Prompt
    columns and masked response tokens never count."""
    sampler_logp = np.array([[-1.0, -2.0, -3.0], [-1.0, -1.0, 0.0], [-0.5, -0.25, -9.0], [-2.0, 0.0, 0.0]])
    old_logp = np.concatenate(
        [
            np.full((4, 2), 7.0),
            sampler_logp + np.array([[0.5, 0.5, 0.5], [0.5, 0.5, 0.5], [0.01, -0.03, 5.0], [0.02, 5.0, 5.0]]),
        ],
        axis=1,
    )
    loss_mask = np.concatenate(
        [
            np.zeros((4, 2), bool),
            np.array(  # the prompt, the response
                [[1, 1, 1], [1, 1, 0], [1, 1, 0], [1, 0, 0]], bool
            ),
        ],
        axis=1,
    )
    carried_B = np.array([True, True, False, False])
    got = step_metrics.logp_agreement(sampler_logp, 2, old_logp, loss_mask, carried_B)
    assert got == pytest.approx(
        {"rollout/logp_diff_mean": 0.02, "rollout/logp_diff_max": 0.03, "rollout/carried_logp_diff_mean": 0.5}
    )
    fresh_only = step_metrics.logp_agreement(sampler_logp, 2, old_logp, loss_mask, np.zeros(4, bool))
    assert fresh_only["rollout/logp_diff_max"] == pytest.approx(0.5)
    assert "rollout/carried_logp_diff_mean" not in fresh_only


def test_length_bucket_by_hand():
    """The smallest power of two b, at least 16, that leaves at most 16 trained widths up to
    Q + L_max."""
    assert train_step.MAX_WIDTHS == train_step.MIN_BUCKET == 16
    # the 32B config: 2048 + 20480 = 22,528, / 16 = 1408 -> 2048: widths 2048, ..., 22,528 (11)
    assert train_step.length_bucket(22_528) == 2048
    # the tiny config: 48 + 96 = 144, / 16 = 9 -> 16: widths 16, ..., 144 (9)
    assert train_step.length_bucket(144) == 16
    # 256 is 16 widths of 16; 257 would need 17 of them, so 32 (9 widths)
    assert (train_step.length_bucket(256), train_step.length_bucket(257)) == (16, 32)
    # the tests' small config: 48 + 40 = 88, / 16 = 6 -> 8, but at least 16
    assert train_step.length_bucket(88) == 16 and train_step.length_bucket(1) == 16


def test_rollout_masks_filtered_and_missing_rows_and_cuts_to_the_length_bucket():
    """Row 0 trains; row 1 is truncated under overlong filtering (loss_keep False); rows 2-3
    stand in for a missing group (valid False). Responses of 2 and 3 tokens in N = 6 columns
    are cut to 4 (length_bucket 2)."""
    mask_BxN = np.arange(6) < np.array([[2], [3], [0], [0]])
    rows = dataclasses.replace(
        gen_batch([True, False, False, False], length_B=[2, 3, 0, 0], reward_B=[1.0, -1.0, 0, 0]),
        prompt_tokens_BxQ=np.full((4, 3), 7, np.int32),
        prompt_mask_BxQ=np.ones((4, 3), bool),
        tokens_BxN=np.where(mask_BxN, 5, 0).astype(np.int32),
        mask_BxN=mask_BxN,
        logp_BxN=np.zeros((4, 6), np.float32),
        loss_keep_B=np.array([True, False, True, True]),
    )
    batch = TrainBatch(rows, valid_B=np.array([True, True, False, False]), carried_B=np.zeros(4, bool))
    got = assembly.host_rollout(batch, group_size=2, normalize_std=False, length_bucket=2)
    np.testing.assert_array_equal(got.tokens_BxT[0], [7, 7, 7, 5, 5, 0, 0])
    np.testing.assert_array_equal(got.mask_BxT[1], [1, 1, 1, 1, 1, 1, 0])
    np.testing.assert_array_equal(got.loss_mask_BxT, [[0, 0, 0, 1, 1, 0, 0]] + [[0] * 7] * 3)
    np.testing.assert_array_equal(got.adv_B, [1.0, -1.0, 0.0, 0.0])  # R - mean; none if missing
    # Prompts of 1-3 tokens left-padded to Q = 6: the 3 leading columns are padding in every row,
    # cut to 4 columns (length_bucket 2); the sampler's log-probs follow the same columns.
    prompt_mask_BxQ = np.arange(6) >= np.array([[3], [5], [4], [6]])
    rows = dataclasses.replace(
        rows,
        prompt_tokens_BxQ=np.where(prompt_mask_BxQ, 7, 0).astype(np.int32),
        prompt_mask_BxQ=prompt_mask_BxQ,
    )
    batch = dataclasses.replace(batch, rows=dataclasses.replace(rows, logp_BxN=np.arange(24.0).reshape(4, 6)))
    got = assembly.host_rollout(batch, group_size=2, normalize_std=False, length_bucket=2)
    assert assembly.prompt_width(batch, 2) == 4
    np.testing.assert_array_equal(got.tokens_BxT[0], [0, 7, 7, 7, 5, 5, 0, 0])
    np.testing.assert_array_equal(got.mask_BxT[1], [0, 0, 0, 1, 1, 1, 1, 0])
    np.testing.assert_array_equal(got.loss_mask_BxT[0], [0, 0, 0, 0, 1, 1, 0, 0])
    np.testing.assert_array_equal(assembly.sampler_logp(batch, 4, 8)[1], [0, 0, 0, 0, 6, 7, 8, 9])


def test_data_metrics_count_valid_rows_only():
    valid = gen_batch([True, False], length_B=[4, 10], score_B=[1.0, -1.0], reward_B=[1.0, -1.5])
    batch = TrainBatch(
        valid.with_zero_rows(2), valid_B=np.array([True, True, False, False]), carried_B=np.zeros(4, bool)
    )
    assert step_metrics.data_metrics(batch) == {
        "data/score_mean": 0.0,
        "data/reward_mean": -0.25,
        "data/acc_mean": 0.5,
        "data/response_length_mean": 7.0,
        "data/response_length_max": 10.0,
        "data/response_length_min": 4.0,
        "data/truncated_fraction": 0.0,
    }

"""Orbax checkpoints: sharded state and host state round-trip; keep-last-N; only complete steps;
a damaged latest checkpoint is skipped, temporary folders are cleaned."""

import logging
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dapo_jax import checkpoint, sharding
from dapo_jax.errors import CheckpointError


def _state(mesh, offset):
    w = jax.device_put(jnp.arange(16.0).reshape(8, 2) + offset, NamedSharding(mesh, P("fsdp")))
    return {"params": {"w": w}, "step": jnp.int32(offset)}


def test_round_trip_keeps_values_shardings_and_host_state(tmp_path):
    mesh = sharding.make_mesh({"fsdp": -1})
    ckpt = checkpoint.Checkpointer(str(tmp_path), keep=2)
    host = {
        "rng": np.array([7, 9], np.uint32),
        "data": {"epoch": 2, "position": 13},
        "carry": {"tokens": np.zeros((0, 4), np.int32), "acc": np.array([True, False])},
        "filter": {"carry": {}},
    }
    for step in (1, 2, 3):
        ckpt.save(step, _state(mesh, step), host)
    ckpt.wait()
    assert ckpt.all_steps() == [2, 3]  # keep-last-2
    assert ckpt.latest_step() == 3
    abstract = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), _state(mesh, 0)
    )
    state, restored = ckpt.restore(2, abstract)
    ckpt.close()
    np.testing.assert_array_equal(np.asarray(state["params"]["w"]), np.arange(16.0).reshape(8, 2) + 2)
    assert state["params"]["w"].sharding.spec == P("fsdp")
    assert int(state["step"]) == 2
    np.testing.assert_array_equal(restored["rng"], [7, 9])
    assert int(restored["data"]["position"]) == 13
    assert restored["carry"]["tokens"].shape == (0, 4) and restored["carry"]["tokens"].dtype == np.int32
    np.testing.assert_array_equal(restored["carry"]["acc"], [True, False])
    assert restored["filter"] == {"carry": {}}


def test_a_new_manager_sees_the_saved_steps(tmp_path):
    mesh = sharding.make_mesh({"fsdp": -1})
    first = checkpoint.Checkpointer(str(tmp_path), keep=3)
    first.save(5, _state(mesh, 5), {"n": np.int64(1)})
    first.close()
    assert checkpoint.Checkpointer(str(tmp_path)).latest_step() == 5


def _truncate_files(folder):
    """Cuts every file under `folder` to half its size, as a save cut by preemption leaves it."""
    for root, _, files in os.walk(folder):
        for name in files:
            path = os.path.join(root, name)
            with open(path, "r+b") as f:
                f.truncate(os.path.getsize(path) // 2)


def test_a_damaged_latest_checkpoint_is_skipped_and_temporary_folders_cleaned(tmp_path, caplog):
    mesh = sharding.make_mesh({"fsdp": -1})
    abstract = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), _state(mesh, 0)
    )
    first = checkpoint.Checkpointer(str(tmp_path), keep=3)
    for step in (1, 2):
        first.save(step, _state(mesh, step), {"n": np.int64(step)})
    first.close()
    leftover = tmp_path / "checkpoints" / "3.orbax-checkpoint-tmp-1700000000"
    leftover.mkdir()
    _truncate_files(tmp_path / "checkpoints" / "2")
    ckpt = checkpoint.Checkpointer(str(tmp_path), keep=3)
    with caplog.at_level(logging.WARNING):
        step, state, host = ckpt.restore_latest(abstract)
    assert (step, int(host["n"])) == (1, 1)
    np.testing.assert_array_equal(np.asarray(state["params"]["w"]), np.arange(16.0).reshape(8, 2) + 1)
    assert any(
        "checkpoint 2 in" in r.getMessage() and "cannot be restored, skipped: " in r.getMessage()
        for r in caplog.records
    )
    assert ckpt.all_steps() == [1]  # the damaged one is gone: the resumed run saves step 2 again
    ckpt.save(2, _state(mesh, 2), {"n": np.int64(2)})
    ckpt.close()
    assert not leftover.exists()


def test_no_checkpoint_that_restores_is_one_error_naming_each(tmp_path):
    mesh = sharding.make_mesh({"fsdp": -1})
    abstract = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), _state(mesh, 0)
    )
    ckpt = checkpoint.Checkpointer(str(tmp_path))
    assert ckpt.restore_latest(abstract) is None  # an empty folder: a fresh start
    for step in (1, 2):
        ckpt.save(step, _state(mesh, step), {"n": np.int64(step)})
        ckpt.wait()
        _truncate_files(tmp_path / "checkpoints" / str(step))
    with pytest.raises(CheckpointError, match=r"^no checkpoint in .* restores: 2 \(.*\); 1 \("):
        ckpt.restore_latest(abstract)
    ckpt.close()


def _two_saved(tmp_path):
    mesh = sharding.make_mesh({"fsdp": -1})
    abstract = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), _state(mesh, 0)
    )
    ckpt = checkpoint.Checkpointer(str(tmp_path))
    for step in (1, 2):
        ckpt.save(step, _state(mesh, step), {"n": np.int64(step)})
    ckpt.wait()
    return ckpt, abstract


def _other_process(monkeypatch, answer):
    """Process 0 of two; process 1's part of each all-gather is `answer(this process's value)`."""
    monkeypatch.setattr(checkpoint.hosts, "allgather_json", lambda mine: [mine, answer(mine)])


def test_a_step_that_fails_on_another_process_is_given_up_by_all(tmp_path, monkeypatch, caplog):
    """Checkpoint 2 restores here but not on process 1 (a transient read error): both restore
    1, the same step, and 2 is deleted to be saved again."""
    ckpt, abstract = _two_saved(tmp_path)
    errors = iter(["process 1: OSError: transient read error"])
    _other_process(monkeypatch, lambda mine: mine if isinstance(mine, list) else next(errors, ""))
    with caplog.at_level(logging.WARNING):
        step, state, host = ckpt.restore_latest(abstract)
    assert (step, int(host["n"])) == (1, 1)
    assert "cannot be restored, skipped: process 1: OSError: transient read error" in caplog.text
    assert ckpt.all_steps() == [1]
    ckpt.close()


def test_processes_that_see_different_checkpoints_stop_with_one_line(tmp_path, monkeypatch):
    ckpt, abstract = _two_saved(tmp_path)
    _other_process(monkeypatch, lambda mine: [1])
    with pytest.raises(CheckpointError, match=r"process 0: \[1, 2\]; process 1: \[1\]\): give every"):
        ckpt.restore_latest(abstract)
    ckpt.close()


def test_a_gs_workdir_stays_a_url(monkeypatch):
    opened = []
    monkeypatch.setattr(
        checkpoint.ocp, "CheckpointManager", lambda directory, **kwargs: opened.append(directory)
    )
    checkpoint.Checkpointer("gs://bucket/run1")
    checkpoint.Checkpointer("runs/local")
    assert [str(d) for d in opened] == [
        "gs://bucket/run1/checkpoints",
        os.path.join(os.getcwd(), "runs/local/checkpoints"),
    ]


def test_installing_needs_python_3_11():
    """pip refuses the package on Python 3.10 with "requires a different Python: ... not in
    '>=3.11'", from this field."""
    setup = open(os.path.join(os.path.dirname(os.path.dirname(__file__)), "setup.py")).read()
    assert 'python_requires=">=3.11"' in setup


def test_a_filter_carry_with_predictions_round_trips_through_orbax(tmp_path):
    from test_dynamic_sampling import ds, gen_batch

    mesh = sharding.make_mesh({"fsdp": -1})
    sampler = ds(1, carry_over=True)
    sampler.add(gen_batch([True, False, False, True, True, False], problem_id_B=[0, 0, 1, 1, 2, 2]))
    sampler.take()  # groups 1 and 2 are carried
    ckpt = checkpoint.Checkpointer(str(tmp_path))
    ckpt.save(1, _state(mesh, 1), {"filter": sampler.state()})
    ckpt.wait()
    abstract = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), _state(mesh, 0)
    )
    _, host = ckpt.restore(1, abstract)
    ckpt.close()
    resumed = ds(1, carry_over=True)
    resumed.restore(host["filter"])
    batch, stats = resumed.take()
    np.testing.assert_array_equal(batch.rows.problem_id_B, [1, 1])
    np.testing.assert_array_equal(batch.rows.pred_B, ["p1", "p1"])
    assert batch.carried_B.all() and stats["dynamic_sampling/groups_carried_in"] == 2

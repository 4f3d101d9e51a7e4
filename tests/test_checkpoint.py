"""Orbax checkpoints: sharded state and host state round-trip; keep-last-N; only complete steps."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from dapo_jax import checkpoint, sharding


def _state(mesh, offset):
    w = jax.device_put(jnp.arange(16.0).reshape(8, 2) + offset, NamedSharding(mesh, P("fsdp")))
    return {"params": {"w": w}, "step": jnp.int32(offset)}


def test_round_trip_keeps_values_shardings_and_host_state(tmp_path):
    mesh = sharding.make_mesh({"fsdp": -1})
    ckpt = checkpoint.Checkpointer(str(tmp_path), keep=2)
    host = {"rng": np.array([7, 9], np.uint32), "data": {"epoch": 2, "position": 13},
            "carry": {"tokens": np.zeros((0, 4), np.int32), "acc": np.array([True, False])},
            "filter": {"carry": {}}}
    for step in (1, 2, 3):
        ckpt.save(step, _state(mesh, step), host)
    ckpt.wait()
    assert ckpt.all_steps() == [2, 3]  # keep-last-2
    assert ckpt.latest_step() == 3
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
                            _state(mesh, 0))
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

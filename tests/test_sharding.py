"""The mesh, the logical-axis rules, and sharded == unsharded on eight fake devices."""

import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from dapo_jax import hf_io, model, sharding


def test_mesh_shape_resolves_the_rest():
    assert sharding.mesh_shape({"data": 2, "fsdp": -1, "tensor": 2}, 8) == (2, 2, 2)
    assert sharding.mesh_shape({"fsdp": -1}, 8) == (1, 8, 1)
    with pytest.raises(ValueError, match="needs 4 devices but 8"):
        sharding.mesh_shape({"data": 2, "tensor": 2}, 8)
    with pytest.raises(ValueError, match="not known"):
        sharding.mesh_shape({"model": 2}, 8)


def _cpu_devices_after(code: str, xla_flags: str) -> list[str]:
    env = {**os.environ, "XLA_FLAGS": xla_flags, "JAX_PLATFORMS": "cpu"}
    prelude = "import jax; from dapo_jax import sharding; "
    out = subprocess.run([sys.executable, "-c", prelude + code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return out.stdout.split() + [line for line in out.stderr.splitlines() if "cpu_devices" in line]


def test_cpu_devices_split_the_host_before_jax_starts_and_yield_to_xla_flags():
    code = (
        "sharding.use_cpu_devices(2); print(jax.local_device_count()); "
        "sharding.use_cpu_devices(3); print(jax.local_device_count())"
    )
    out = _cpu_devices_after(code, "")
    assert out[:2] == ["2", "2"]  # the second call comes after JAX started: kept, and said so
    assert "cpu_devices 3 not applied: JAX started with 2 CPU devices" in out[2]
    code = "sharding.use_cpu_devices(2); print(jax.local_device_count())"
    assert _cpu_devices_after(code, "--xla_force_host_platform_device_count=3")[0] == "3"
    assert _cpu_devices_after("sharding.use_cpu_devices(0); print(jax.local_device_count())", "") == ["1"]


def test_sharded_forward_equals_single_device(qwen2_dir):
    cfg = hf_io.config_from_hf(hf_io.read_hf_config(qwen2_dir), dtype="float32")
    m = model.Transformer(cfg)
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, cfg.vocab_size, size=(8, 12)).astype(np.int32)
    mask = np.ones_like(tokens, bool)
    mask[::2, :5] = False  # left padding on every other row

    single = sharding.make_mesh({"data": -1}, devices=jax.devices()[:1])
    ref = model.forward(m, hf_io.load_params(qwen2_dir, m, single), tokens, mask)

    mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    params = hf_io.load_params(qwen2_dir, m, mesh)
    # Parameters are sharded as RULES say: embed over fsdp, heads / mlp / vocab over tensor.
    layer = params["layers_0"]
    assert layer["self_attn"]["q_proj"]["kernel"].sharding.spec == P("fsdp", "tensor")
    assert layer["self_attn"]["o_proj"]["kernel"].sharding.spec == P("tensor", "fsdp")
    assert layer["mlp"]["down_proj"]["kernel"].sharding.spec == P("tensor", "fsdp")
    assert layer["self_attn"]["k_proj"]["bias"].sharding.spec == P("tensor")
    assert params["embed_tokens"]["embedding"].sharding.spec == P("tensor", "fsdp")
    kernel = layer["mlp"]["gate_proj"]["kernel"]
    assert {s.data.shape for s in kernel.addressable_shards} == {(32, 48)}  # (64/2, 96/2)

    batch = sharding.batch_sharding(mesh, 2)
    with sharding.activate(mesh):
        logits = jax.jit(lambda p, t, k: model.forward(m, p, t, k))(
            params, jax.device_put(tokens, batch), jax.device_put(mask, batch)
        )
    assert logits.sharding.spec == P(("data", "fsdp"), None, "tensor")
    np.testing.assert_allclose(np.asarray(logits)[mask], np.asarray(ref)[mask], atol=1e-5)


def test_init_params_is_born_sharded():
    cfg = model.ModelConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_layers=1,
        num_heads=2,
        num_kv_heads=2,
        head_dim=8,
        dtype="float32",
    )
    mesh = sharding.make_mesh({"fsdp": 4, "tensor": 2})
    params = sharding.init_params(model.Transformer(cfg), mesh, jax.random.key(0))
    up = params["layers_0"]["mlp"]["up_proj"]["kernel"]
    assert up.sharding.spec == P("fsdp", "tensor")
    assert {s.data.shape for s in up.addressable_shards} == {(4, 16)}
    n = sum(x.size for x in jax.tree.leaves(params))
    assert n == cfg.num_params()

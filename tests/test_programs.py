"""The one program builder on eight fake devices: the rollout's mesh and weights, the cast compiled
once, the engine's sizes from the chip's memory, and the abstract inputs the AOT check lowers."""

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from configs import dapo
from dapo_jax import hf_io, hf_model_config, model, overrides, programs, sharding


def _tiny(**keys):
    return overrides.apply(dapo.get_config("tiny"), keys)


def _model_config(qwen2_dir, dtype="float32"):
    return hf_model_config.config_from_hf(hf_model_config.read_hf_config(qwen2_dir), dtype=dtype)


def test_the_samplers_compute_dtype_is_set_apart_from_the_trainers():
    """rollout.dtype: a bf16 trainer with an f32 sampler on the same mesh and the same weights."""
    c = _tiny(**{"model.dtype": "bfloat16", "rollout.dtype": "float32"})
    m = model.Transformer(
        model.ModelConfig(
            vocab_size=8,
            hidden_size=8,
            intermediate_size=8,
            num_layers=1,
            num_heads=2,
            num_kv_heads=1,
            head_dim=4,
            dtype="bfloat16",
        )
    )
    mesh = sharding.make_mesh({"data": -1}, devices=jax.devices()[:1])
    sampler_model, sampler_mesh, cast = programs.rollout_layout(c, m, mesh)
    assert sampler_model.config.dtype == "float32" and m.config.dtype == "bfloat16"
    assert sampler_model.config.param_dtype == m.config.param_dtype and sampler_mesh is mesh
    assert cast is None
    c.rollout.dtype = None
    assert programs.rollout_layout(c, m, mesh)[0] is m


def test_rollout_weights_are_cast_by_one_program_onto_a_tensor_parallel_mesh(qwen2_dir):
    c = _tiny(
        **{
            "mesh.data": 1,
            "mesh.fsdp": 4,
            "mesh.tensor": 2,
            "rollout.param_dtype": "bfloat16",
        }
    )
    p = programs.build(c, _model_config(qwen2_dir), (1,), 0)
    assert dict(p.rollout_mesh.shape) == {"data": 4, "fsdp": 1, "tensor": 2}
    assert set(p.rollout_mesh.devices.flat) == set(p.mesh.devices.flat)
    assert p.sampler.mesh is p.eval_sampler.mesh is p.rollout_mesh and p.sampler.model is p.rollout_model
    params = hf_io.load_params(qwen2_dir, p.model, p.mesh)
    for _ in range(3):  # one rollout step after another
        moved = p.rollout_weights(params)
    assert p.cast._cache_size() == 1  # compiled once, not once a step
    kernel = moved["layers_0"]["mlp"]["up_proj"]["kernel"]
    assert kernel.dtype == np.dtype("bfloat16") and kernel.sharding.mesh == p.rollout_mesh
    assert kernel.addressable_shards[0].data.shape == (64, 48)  # embed whole (fsdp 1), mlp over tensor
    jax.tree.map(
        lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b).astype(a.dtype)),
        moved,
        params,
    )


def test_abstract_inputs_hold_each_programs_arguments_and_what_stays_resident(qwen2_dir):
    c = _tiny(
        **{
            "mesh.data": 2,
            "mesh.fsdp": 2,
            "mesh.tensor": 2,
            "rollout.param_dtype": "bfloat16",
        }
    )
    cfg = _model_config(qwen2_dir)
    p = programs.build(c, cfg, (1,), 0)
    inputs = programs.abstract_inputs(p, c)
    assert sorted(inputs) == ["cast", "eval", "logprobs", "rollout", "train"]
    # f32 weights over fsdp x tensor, AdamW's two moments alike, then bf16 over tensor 2: the
    # per-chip bytes counted from each leaf's spec (every axis divides: no padding of shards)
    params = inputs["logprobs"].args[0]
    f32 = _bytes_by_spec(params)
    assert programs.per_chip_bytes(params) == f32 and 0 < f32 < cfg.num_params() * 4 / 2
    assert programs.per_chip_bytes(inputs["logprobs"].resident) == pytest.approx(2 * f32, abs=64)
    bf16 = _bytes_by_spec(inputs["rollout"].args[0])
    assert programs.per_chip_bytes(inputs["rollout"].args[0]) == bf16 and bf16 != f32 / 2
    assert programs.per_chip_bytes(inputs["rollout"].resident) == pytest.approx(3 * f32, abs=64)
    tokens = inputs["train"].args[1].tokens_BxT
    assert tokens.shape == (8 * 8, 48 + 96) and tokens.sharding.spec == P(("data", "fsdp"), None)
    prompt = inputs["eval"].args[1]
    assert prompt.shape == (128, 48)  # 125 prompts filled up to a multiple of the 4 data shards


def _bytes_by_spec(tree) -> float:
    """Per-chip bytes: each leaf's bytes over the product of the mesh axes its spec names."""
    total = 0.0
    for a in jax.tree.leaves(tree):
        names = [
            n for entry in a.sharding.spec if entry for n in ((entry,) if isinstance(entry, str) else entry)
        ]
        total += a.size * a.dtype.itemsize / np.prod([a.sharding.mesh.shape[n] for n in names])
    return total


def test_the_engines_sizes_follow_the_chips_memory(qwen2_dir):
    """tiny with the engine on 8 data shards: a generation batch of 64 prompts is 8 a shard, 64
    rows; an eval batch of 125 prompts is filled to 128, 16 a shard, 64 rows at 4 samples. With
    room to spare every row of a shard has a slot and a call takes all its prompts; where the
    chip reports no memory (None) the engine decodes all rows at once, unplanned."""
    c = _tiny(**{"cpu_variants": False})
    cfg = _model_config(qwen2_dir)
    roomy = programs.build(c, cfg, (1,), 0, hbm=2**40)
    assert (roomy.sampler.config.decode_slots, roomy.sampler.micro_batch_prompts) == (64 * 8, 8 * 8)
    assert (roomy.eval_sampler.config.decode_slots, roomy.eval_sampler.micro_batch_prompts) == (
        64 * 8,
        16 * 8,
    )
    assert (roomy.sizes.rollout_prompts, roomy.sizes.eval_prompts) == (64, 125)
    unknown = programs.build(c, cfg, (1,), 0)
    assert (unknown.sampler.config.decode_slots, unknown.sampler.micro_batch_prompts) == (None, None)
    fixed = programs.build(_tiny(), cfg, (1,), 0, hbm=2**40)  # cpu_variants: the fixed batch
    assert (fixed.sampler.config.decode_slots, fixed.sampler.micro_batch_prompts) == (None, None)

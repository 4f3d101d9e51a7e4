"""The mesh, the logical-axis rules, and sharded == unsharded on eight fake devices."""

from typing import NamedTuple

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from dapo_jax import hf_io, hf_model_config, model, sharding
from dapo_jax.errors import ConfigError


def test_mesh_shape_resolves_the_rest():
    assert sharding.mesh_shape({"data": 2, "fsdp": -1, "tensor": 2}, 8) == (2, 2, 2)
    assert sharding.mesh_shape({"fsdp": -1}, 8) == (1, 8, 1)
    with pytest.raises(ValueError, match="needs 4 devices but 8"):
        sharding.mesh_shape({"data": 2, "tensor": 2}, 8)
    with pytest.raises(ValueError, match="not known"):
        sharding.mesh_shape({"model": 2}, 8)


def test_sharded_forward_equals_single_device(qwen2_dir):
    cfg = hf_model_config.config_from_hf(hf_model_config.read_hf_config(qwen2_dir), dtype="float32")
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


def test_abstract_sharded_params_are_the_shapes_laid_out_as_init_params():
    cfg = model.ModelConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_layers=1,
        num_heads=2,
        num_kv_heads=2,
        head_dim=8,
    )
    mesh = sharding.make_mesh({"fsdp": 4, "tensor": 2})
    abstract = sharding.abstract_sharded_params(model.Transformer(cfg), mesh, "bfloat16")
    up = abstract["layers_0"]["mlp"]["up_proj"]["kernel"]
    assert (up.shape, up.dtype, up.sharding.spec) == ((16, 32), np.dtype("bfloat16"), P("fsdp", "tensor"))
    assert sum(x.size for x in jax.tree.leaves(abstract)) == cfg.num_params()
    assert {x.dtype for x in jax.tree.leaves(abstract)} == {np.dtype("bfloat16")}
    as_stored = sharding.abstract_sharded_params(model.Transformer(cfg), mesh)  # param_dtype float32
    assert {x.dtype for x in jax.tree.leaves(as_stored)} == {np.dtype("float32")}


class _FakeChip(NamedTuple):
    """A TPU chip as `mesh_utils` reads one: its torus coordinates and core, nothing to run on."""

    id: int
    coords: tuple[int, int, int]
    core_on_chip: int = 0
    platform: str = "tpu"
    device_kind: str = "TPU v5"
    slice_index: int = 0


def _v5p_4x4x4() -> list[_FakeChip]:
    """v5p-128's 64 chips in the order jax lists them: hosts of 2 x 2 chips, x fastest."""
    coords = [
        (hx * 2 + x, hy * 2 + y, z)
        for z in range(4)
        for hy in range(2)
        for hx in range(2)
        for y in range(2)
        for x in range(2)
    ]
    return [_FakeChip(i, c) for i, c in enumerate(coords)]


def _box_volume(chips) -> int:
    """Chips in the smallest box of the torus that holds them (a ring or plane of neighbours:
    their count)."""
    c = np.array([chip.coords for chip in chips])
    return int(np.prod(c.max(0) - c.min(0) + 1))


@pytest.mark.parametrize("shape", [(1, 8, 8), (1, 16, 4), (2, 4, 8), (8, 1, 8), (4, 4, 4), (64, 1, 1)])
def test_device_grid_places_tensor_groups_on_neighbouring_chips_of_the_torus(shape):
    chips = _v5p_4x4x4()
    grid = sharding.device_grid(shape, chips)
    assert grid.shape == shape and sorted(d.id for d in grid.flat) == list(range(64))
    tensor_groups = grid.reshape(-1, shape[2])
    assert all(_box_volume(group) == shape[2] for group in tensor_groups)
    model_groups = grid.reshape(shape[0], -1)  # fsdp x tensor: one data replica's chips
    assert all(_box_volume(group) == shape[1] * shape[2] for group in model_groups)


def test_device_grid_keeps_the_order_of_devices_without_coordinates_and_one_slice():
    devices = jax.devices()[::-1]
    assert list(sharding.device_grid((2, 2, 2), devices).flat) == devices
    two_slices = [chip._replace(slice_index=chip.id // 32) for chip in _v5p_4x4x4()]
    with pytest.raises(ValueError, match="span 2 TPU slices"):
        sharding.device_grid((1, 8, 8), two_slices)


def test_mesh_of_abstract_v5p_128_chips_splits_physical_axes():
    """The real libtpu devices of v5p-128 (the tpu extra); skipped where libtpu is absent (CI)."""
    from dapo_jax import chips  # noqa: PLC0415

    try:
        _, devices = chips.topology_devices("v5p-128")
    except ConfigError as e:
        pytest.skip(f"no abstract TPU devices here: {e}")
    for sizes in ({"fsdp": -1, "tensor": 8}, {"fsdp": 16, "tensor": 4}, {"data": 2, "fsdp": 4, "tensor": 8}):
        mesh = sharding.make_mesh(sizes, devices)
        assert mesh.devices.size == 64 and mesh.shape["tensor"] == sizes["tensor"]
        groups = mesh.devices.reshape(-1, sizes["tensor"])
        assert all(_box_volume(group) == sizes["tensor"] for group in groups)

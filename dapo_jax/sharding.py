"""The device mesh (data / fsdp / tensor) and the one table of logical-axis rules.

Parameters and activations are annotated with logical names (`model.py`); `RULES` maps each name
onto mesh axes, in order of preference: a mesh axis already taken by an earlier dimension of the same
array falls through to the next rule, so activations `("batch", "length", "embed")` shard the batch
over data x fsdp and keep `embed` whole, while parameters `("embed", "mlp")` shard over fsdp x tensor.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping

import flax.linen as nn
import jax
import numpy as np
from jax.experimental import mesh_utils, multihost_utils
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor")

RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    ("batch", ("data", "fsdp")),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("length", None),
    ("norm", None),
    ("head_dim", None),  # Qwen3's q/k norm scales: one head's width, replicated
    ("layers", None),  # the stacked layer axis of a scanned model: every layer on every shard
)


def loop_per_data_shard(loop, mesh: Mesh):
    """`loop(params, prompt_PxQ, mask_PxQ, uids_P, rng)` run by each data x fsdp shard of `mesh` on
    its P / d prompts, all their rows (`jax.shard_map`, manual over data and fsdp only): tensor
    parallel inside a shard (the weights split over `tensor` as they lie, the batch axis not
    split further), no shard waiting for another's longest row. P must split evenly."""
    rows = PartitionSpec(("data", "fsdp"))
    manual = ("data", "fsdp")
    auto_only = tuple((name, None if axes in manual or axes == manual else axes) for name, axes in RULES)

    def per_shard(*args):
        with nn.logical_axis_rules(auto_only):  # inside a shard only tensor is left to split
            return loop(*args)

    return jax.shard_map(
        per_shard,
        mesh=mesh,
        in_specs=(PartitionSpec(), rows, rows, rows, PartitionSpec()),
        out_specs=rows,
        axis_names={"data", "fsdp"},
        check_vma=False,
    )


def splits_only_the_batch(mesh: Mesh) -> bool:
    """Whether `mesh` has several devices, all on the data axis (fsdp = tensor = 1): each device
    holds all the weights and can run its batch shard's decode loop or gradient by itself."""
    return mesh.shape["data"] > 1 and mesh.shape["fsdp"] == mesh.shape["tensor"] == 1


def mesh_shape(sizes: Mapping[str, int], num_devices: int) -> tuple[int, ...]:
    """Resolve the configured axis sizes, one of which may be -1 ("the rest")."""
    unknown = [k for k in sizes if k not in MESH_AXES]
    if unknown:
        raise ValueError(f"mesh axes {unknown} are not known; use {MESH_AXES}")
    shape = [int(sizes.get(a, 1)) for a in MESH_AXES]
    if shape.count(-1) > 1:
        raise ValueError(f"mesh {dict(sizes)}: at most one axis may be -1")
    fixed = math.prod(s for s in shape if s != -1)
    if -1 in shape:
        if num_devices % fixed:
            raise ValueError(f"mesh {dict(sizes)}: {num_devices} devices are not divisible by {fixed}")
        shape[shape.index(-1)] = num_devices // fixed
    if math.prod(shape) != num_devices:
        raise ValueError(
            f"mesh {dict(zip(MESH_AXES, shape))} needs {math.prod(shape)} devices but "
            f"{num_devices} are present; set one axis to -1 to take the rest"
        )
    return tuple(shape)


def device_grid(shape: tuple[int, ...], devices) -> np.ndarray:
    """`devices` arranged as a (data, fsdp, tensor) array of `shape`, from their physical topology:
    on TPU (devices with torus `coords`) `mesh_utils.create_device_mesh` maps the tensor axis, then
    fsdp, then data, onto neighbouring chips, splitting a physical axis where the shape needs it
    (v5p-128's 4x4x4 torus has no axis of 8, so tensor = 8 takes 4 x 2 of two axes); devices
    without coordinates (CPU) in their given order. One slice only."""
    devices = list(devices)
    slices = {getattr(d, "slice_index", 0) for d in devices}
    if len(slices) > 1:
        raise ValueError(
            f"the {len(devices)} devices span {len(slices)} TPU slices; the mesh builds one slice's "
            "devices only (a multi-slice mesh would put the data axis across slices)"
        )
    if all(getattr(d, "coords", None) is not None for d in devices) and devices[0].platform == "tpu":
        return mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
    return np.asarray(devices).reshape(shape)


def make_mesh(sizes: Mapping[str, int], devices=None) -> Mesh:
    """The mesh of `sizes` (`mesh_shape`) over all (or the given) devices, laid out by
    `device_grid`, with automatic sharding on every axis: the one builder of every mesh a run,
    an evaluation, an export or the AOT check uses."""
    devices = jax.devices() if devices is None else list(devices)
    grid = device_grid(mesh_shape(sizes, len(devices)), devices)
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


@contextlib.contextmanager
def activate(mesh: Mesh):
    """Make `mesh` and `RULES` current, so that logical constraints in the model take effect."""
    with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
        yield


def on_mesh(jitted, mesh):
    """`jitted` traced and run under `activate(mesh)` (logical constraints apply)."""

    def call(*args):
        with activate(mesh):
            return jitted(*args)

    def lower(*args):
        with activate(mesh):
            return jitted.lower(*args)

    call.lower = lower
    return call


def logical_to_sharding(logical_tree, mesh: Mesh):
    """Map a tree of logical PartitionSpecs to NamedShardings on `mesh` under `RULES`."""
    return nn.logical_to_mesh_sharding(logical_tree, mesh, RULES)


def batch_sharding(mesh: Mesh, ndim: int) -> NamedSharding:
    """Leading (batch) dimension over data x fsdp, the rest replicated."""
    return NamedSharding(mesh, PartitionSpec(("data", "fsdp"), *([None] * (ndim - 1))))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def to_host(x) -> np.ndarray:
    """A (possibly multi-host sharded) array as one numpy array on every process."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(jax.device_get(x))


def _dummy_inputs():
    tokens = np.zeros((1, 1), np.int32)
    return tokens, tokens, np.ones((1, 1, 1), bool)


def _boxed_abstract_params(model: nn.Module):
    return jax.eval_shape(lambda: model.init(jax.random.key(0), *_dummy_inputs())["params"])


def abstract_params(model: nn.Module):
    """The parameters as ShapeDtypeStructs: shapes first, nothing allocated."""
    return nn.unbox(_boxed_abstract_params(model))


def logical_param_specs(model: nn.Module):
    """The parameters' logical PartitionSpecs, e.g. `P("embed", "mlp")` for a gate kernel."""
    return nn.get_partition_spec(_boxed_abstract_params(model))


def param_shardings(model: nn.Module, mesh: Mesh):
    """NamedShardings of every parameter of `model` on `mesh`, as `RULES` says."""
    return logical_to_sharding(logical_param_specs(model), mesh)


def with_shardings(tree, shardings):
    """ShapeDtypeStructs of the shapes and dtypes of `tree`'s leaves, each with its sharding."""
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, shardings)


def abstract_sharded_params(model: nn.Module, mesh: Mesh, dtype=None):
    """The parameters as ShapeDtypeStructs laid out on `mesh` (`param_shardings`), all in `dtype`
    when given: a program's parameter inputs for lowering ahead of time, nothing allocated."""
    abstract = abstract_params(model)
    if dtype is not None:
        abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, dtype), abstract)
    return with_shardings(abstract, param_shardings(model, mesh))


def init_params(model: nn.Module, mesh: Mesh, rng: jax.Array):
    """Random parameters born sharded: shapes first, then one jit with `out_shardings`."""
    shardings = param_shardings(model, mesh)

    def init(rng):
        return nn.unbox(model.init(rng, *_dummy_inputs())["params"])

    with activate(mesh):
        return jax.jit(init, out_shardings=shardings)(rng)

"""What the rollout engine (`engine`) reads from HBM per decode step: a count by hand (the roofline)
and the engine's own programs to compile against it (`aot`, program `engine`).

The count, per chip of one data shard's tensor group (T chips), for a generation batch of rows
b with prompts of q_b tokens and responses of r_b tokens, decoded in S slots:
- steps: rows start in order, each in the slot that frees first, and hold it for r_b steps
  (`engine.step` starts a waiting row in the step a row ends); the loop lasts until the last
  slot's queue ends.
- weights: every step reads the bf16 weights but the embedding table (S rows of it are looked
  up), W / T bytes.
- pages: at its t-th step (t = 0 .. r_b - 1) row b holds q_b + t keys and reads their
  ceil((q_b + t) / Z) pages, each Z slots x 2K heads x E wide per layer (a prompt's shared pages
  are read by each row holding them); 2K / T heads lie on a chip.
"""

from __future__ import annotations

import dataclasses
import heapq
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from dapo_jax import engine, model, programs, sharding, sizes
from dapo_jax.paged_attention import kernel_decode_attention, paged_decode_attention


class EngineCount(NamedTuple):
    """A data shard's decode loop counted by hand, bytes per chip of its tensor group."""

    steps: int  # decode steps until the last row ends
    tokens: int  # sum of r_b: the useful tokens the shard decodes
    pairs: int  # sum over rows and steps of the pages read, (row, page) pairs per layer
    weight_bytes: float  # W / T: read every step
    page_bytes: float  # one page of all layers on one chip: Z x 2K / T x E x itemsize x layers

    @property
    def bytes_per_step(self) -> float:
        """The mean step's HBM reads: the weights and the pages held by the rows it decodes."""
        return self.weight_bytes + self.pairs * self.page_bytes / self.steps


def engine_count(cfg: model.ModelConfig, tensor: int, prompt_B, response_B, page_size: int, slots: int):
    """`EngineCount` of rows with `prompt_B` prompt and `response_B` response tokens decoded in
    `slots` slots over pages of `page_size` on `tensor` chips (module docstring)."""
    prompt_B, response_B = np.asarray(prompt_B, np.int64), np.asarray(response_B, np.int64)
    free_S = [0] * min(slots, len(response_B))  # the step each slot frees at
    for r in response_B:
        heapq.heapreplace(free_S, free_S[0] + int(r))
    z = page_size

    def pages_upto(n):  # sum of ceil(k / Z) for k = 1 .. n
        full, rest = n // z, n % z
        return z * full * (full + 1) // 2 + rest * (full + 1)

    pairs = pages_upto(prompt_B + response_B - 1) - pages_upto(prompt_B - 1)
    embedding = 0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size
    itemsize = np.dtype(cfg.compute_dtype).itemsize
    return EngineCount(
        steps=max(free_S),
        tokens=int(response_B.sum()),
        pairs=int(pairs.sum()),
        weight_bytes=(cfg.num_params() - embedding) * 2 / tensor,
        page_bytes=z * 2 * cfg.num_kv_heads * cfg.head_dim * itemsize * cfg.num_layers / tensor,
    )


class Shard(NamedTuple):
    """A data shard's engine: its sampling config (its share of the slots) and sizes."""

    config: object  # sampler.SamplingConfig
    geometry: engine.Geometry
    prompts: int  # P / d
    shards: int  # d: data x fsdp shards of the rollout mesh


def shard(p: programs.Programs, c) -> Shard:
    """The engine each data x fsdp shard runs for one rollout micro-batch (`Sampler` with
    `rollout.paged`: a loop per shard on its P / d prompts and decode_slots / d slots)."""
    s, mesh = programs.program_sizes(c), p.rollout_mesh
    d = mesh.shape["data"] * mesh.shape["fsdp"]
    config = dataclasses.replace(
        p.sampler.config, paged=True, decode_slots=p.sampler.config.decode_slots // d
    )
    prompts = sizes.padded_count(s.rollout_prompts, d, s.group) // d
    return Shard(config, engine.geometry(config, prompts, s.group, s.prompt_len), prompts, d)


def step_program(p: programs.Programs, c, layers: int) -> programs.Lowerable:
    """One engine step (`engine.step`: decode, free ended rows, start waiting ones) of every data
    shard on its own state, the rollout model cut to `layers` layers (unscanned: XLA's cost
    analysis counts a loop's body once), the pools' heads split over tensor as the weights' are;
    the state donated."""
    mesh, sh = p.rollout_mesh, shard(p, c)
    m = model.Transformer(dataclasses.replace(p.rollout_model.config, num_layers=layers, scan_layers=False))
    group, geo, n_new = programs.program_sizes(c).group, sh.geometry, sh.config.max_new_tokens
    raw = jax.eval_shape(
        lambda: engine.initial_state(
            engine.empty_pools(m.config, geo.pool_pages, geo.page_size), geo, n_new, 0
        )
    )
    i32 = jax.ShapeDtypeStruct((sh.prompts,), jnp.int32)
    prompts = engine.Prompts(i32, i32, i32, jax.ShapeDtypeStruct((sh.prompts,), bool))
    u_BxN = jax.ShapeDtypeStruct((geo.rows, n_new), jnp.float32)

    def stacked(a, heads=False):  # every shard's leaf, on a leading axis split over data x fsdp
        spec = (("data", "fsdp"), *[None] * (a.ndim - 2), "tensor", None) if heads else (("data", "fsdp"),)
        return jax.ShapeDtypeStruct(
            (sh.shards, *a.shape), a.dtype, sharding=NamedSharding(mesh, PartitionSpec(*spec))
        )

    state = jax.tree.map(stacked, raw)._replace(pools=[stacked(x, heads=True) for x in raw.pools])
    first = lambda tree: jax.tree.map(lambda x: x[0], tree)

    def per_shard(params, st, prompts, u_BxN, _):
        st = engine.step(m, params, sh.config, geo, first(prompts), group, first(u_BxN), first(st))
        return jax.tree.map(lambda x: x[None], st)

    fn = jax.jit(engine.loop_per_data_shard(per_shard, mesh), donate_argnums=(1,))
    args = (_params(m, mesh), state, jax.tree.map(stacked, prompts), stacked(u_BxN), _scalar(mesh))
    return programs.Lowerable(_InMesh(fn, mesh), args, ())


def prefill_program(p: programs.Programs, c) -> programs.Lowerable:
    """The engine's prefill (`engine.prefill_pages`: empty pools, the prompts' pages filled) of
    every data shard on its P / d prompts, the rollout model as configured."""
    mesh, sh, s = p.rollout_mesh, shard(p, c), programs.program_sizes(c)
    m, rows = p.rollout_model, NamedSharding(mesh, PartitionSpec(("data", "fsdp")))

    def per_shard(params, prompt_PxL, mask_PxL, _, __):
        pools = engine.prefill_pages(m, params, prompt_PxL, mask_PxL, sh.geometry)
        return jax.tree.map(lambda x: x[None], pools)

    fn = jax.jit(engine.loop_per_data_shard(per_shard, mesh))
    prompt = lambda dtype: jax.ShapeDtypeStruct((sh.prompts * sh.shards, s.prompt_len), dtype, sharding=rows)
    uids = jax.ShapeDtypeStruct((sh.prompts * sh.shards,), jnp.int32, sharding=rows)
    return programs.Lowerable(
        _InMesh(fn, mesh), (_params(m, mesh), prompt(jnp.int32), prompt(bool), uids, _scalar(mesh)), ()
    )


def _params(m: model.Transformer, mesh):
    return jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
        sharding.abstract_params(m),
        sharding.param_shardings(m, mesh),
    )


def _scalar(mesh):
    return jax.ShapeDtypeStruct((), jnp.int32, sharding=sharding.replicated(mesh))


class _InMesh(NamedTuple):
    """A jitted function whose `lower` runs with `mesh` current (the logical axis rules for the
    model's constraints; the TPU kind for Pallas)."""

    fn: object
    mesh: jax.sharding.Mesh

    def lower(self, *args):
        with sharding.activate(self.mesh):
            return self.fn.lower(*args)


def attention_programs(p: programs.Programs, c, block_pages: int) -> dict[str, programs.Lowerable]:
    """One layer's decode attention on one chip of a data shard's tensor group (its 2K / T heads
    of the shard's pools and its S rows' queries): `pure` (`paged_decode_attention` in blocks of
    `block_pages` (row, page) pairs) and `kernel` (jax's ragged paged attention, TPU only)."""
    cfg, sh, mesh = p.rollout_model.config, shard(p, c), p.rollout_mesh
    tensor, geo = mesh.shape["tensor"], sh.geometry
    one = jax.sharding.Mesh(np.asarray(mesh.devices.flat[:1]), ("x",))
    rep = NamedSharding(one, PartitionSpec())
    k = cfg.num_kv_heads // tensor
    args = (
        jax.ShapeDtypeStruct(
            (geo.slots, k, cfg.num_heads // cfg.num_kv_heads, cfg.head_dim), cfg.compute_dtype, sharding=rep
        ),
        jax.ShapeDtypeStruct(
            (geo.pool_pages, geo.page_size, 2 * k, cfg.head_dim), cfg.compute_dtype, sharding=rep
        ),
        jax.ShapeDtypeStruct((geo.slots,), jnp.int32, sharding=rep),
        jax.ShapeDtypeStruct((geo.slots, geo.table_pages), jnp.int32, sharding=rep),
    )
    pure = jax.jit(lambda *a: paged_decode_attention(*a, block_pages))
    kernel = jax.jit(kernel_decode_attention)
    return {
        "pure": programs.Lowerable(_InMesh(pure, one), args, ()),
        "kernel": programs.Lowerable(_InMesh(kernel, one), args, ()),
    }

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
- the Pallas kernel (`paged_attention.kernel_decode_attention`) fetches a row's pages in blocks
  of C pages, whole blocks (a block past the row's last page fetches its first page again):
  C x ceil((q_b + t) / (Z C)) pages. Its fetches are DMAs that no count of the compiled
  program sees (`hbm_bytes`, XLA's cost analysis); `aot_engine` adds them to a step's bytes by this one.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import re
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
    kernel_pairs: int  # the same in the kernel's whole blocks of C pages
    weight_bytes: float  # W / T: read every step
    page_bytes: float  # one page of all layers on one chip: Z x 2K / T x E x itemsize x layers

    @property
    def bytes_per_step(self) -> float:
        """The mean step's HBM reads: the weights and the pages held by the rows it decodes."""
        return self.weight_bytes + self.pairs * self.page_bytes / self.steps


def engine_count(
    cfg: model.ModelConfig, tensor: int, prompt_B, response_B, page_size: int, slots: int, block_pages: int
):
    """`EngineCount` of rows with `prompt_B` prompt and `response_B` response tokens decoded in
    `slots` slots over pages of `page_size` on `tensor` chips, the kernel's blocks of
    C = `block_pages` pages (module docstring)."""
    prompt_B, response_B = np.asarray(prompt_B, np.int64), np.asarray(response_B, np.int64)
    free_S = [0] * min(slots, len(response_B))  # the step each slot frees at
    for r in response_B:
        heapq.heapreplace(free_S, free_S[0] + int(r))

    def pages_upto(n, z):  # sum of ceil(k / z) for k = 1 .. n
        full, rest = n // z, n % z
        return z * full * (full + 1) // 2 + rest * (full + 1)

    held = lambda z: pages_upto(prompt_B + response_B - 1, z) - pages_upto(prompt_B - 1, z)
    pairs, blocks = held(page_size), held(page_size * block_pages)
    embedding = 0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size
    itemsize = np.dtype(cfg.compute_dtype).itemsize
    return EngineCount(
        steps=max(free_S),
        tokens=int(response_B.sum()),
        pairs=int(pairs.sum()),
        kernel_pairs=int(block_pages * blocks.sum()),
        weight_bytes=(cfg.num_params() - embedding) * 2 / tensor,
        page_bytes=page_size * 2 * cfg.num_kv_heads * cfg.head_dim * itemsize * cfg.num_layers / tensor,
    )


class Shard(NamedTuple):
    """A data shard's engine: its sampling config (its share of the slots) and sizes."""

    config: object  # decoding.SamplingConfig
    geometry: engine.Geometry
    prompts: int  # P / d
    shards: int  # d: data x fsdp shards of the rollout mesh


def shard(p: programs.Programs, c) -> Shard:
    """The engine each data x fsdp shard runs for one rollout micro-batch (`Sampler` with
    the engine: a loop per shard on its P / d prompts and decode_slots / d slots)."""
    s, mesh = p.sizes, p.rollout_mesh
    d = mesh.shape["data"] * mesh.shape["fsdp"]
    config = dataclasses.replace(p.sampler.config.for_shard(d), paged=True)
    prompts = sizes.padded_count(s.rollout_prompts, d) // d
    return Shard(config, engine.geometry(config, prompts, s.group, s.prompt_len), prompts, d)


def step_program(p: programs.Programs, c, layers: int) -> programs.Lowerable:
    """One engine step (`engine.step`: decode, free ended rows, start waiting ones) of every data
    shard on its own state, the rollout model cut to `layers` layers (unscanned: `hbm_bytes`
    counts a loop's body once), the pool's heads split over tensor as the weights' are;
    the state donated."""
    mesh, sh = p.rollout_mesh, shard(p, c)
    m = model.Transformer(dataclasses.replace(p.rollout_model.config, num_layers=layers, scan_layers=False))
    group, geo, n_new = p.sizes.group, sh.geometry, sh.config.max_new_tokens
    raw = jax.eval_shape(
        lambda: engine.initial_state(
            engine.empty_pool(m.config, geo.pool_pages, geo.page_size), geo, n_new, 0
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

    state = jax.tree.map(stacked, raw)._replace(pool=stacked(raw.pool, heads=True))
    first = lambda tree: jax.tree.map(lambda x: x[0], tree)

    def per_shard(params, st, prompts, u_BxN, _):
        st = engine.step(m, params, sh.config, geo, first(prompts), group, first(u_BxN), first(st))
        return jax.tree.map(lambda x: x[None], st)

    fn = jax.jit(sharding.loop_per_data_shard(per_shard, mesh), donate_argnums=(1,))
    args = (
        sharding.abstract_sharded_params(m, mesh),
        state,
        jax.tree.map(stacked, prompts),
        stacked(u_BxN),
        _scalar(mesh),
    )
    return programs.Lowerable(_InMesh(fn, mesh), args, ())


def prefill_program(p: programs.Programs, c) -> programs.Lowerable:
    """The engine's prefill (`engine.prefill_pages`: the pool, the prompts' pages filled) of
    every data shard on its P / d prompts, the rollout model as configured."""
    mesh, sh, s = p.rollout_mesh, shard(p, c), p.sizes
    m, rows = p.rollout_model, NamedSharding(mesh, PartitionSpec(("data", "fsdp")))

    def per_shard(params, prompt_PxQ, mask_PxQ, _, __):
        return engine.prefill_pages(m, params, prompt_PxQ, mask_PxQ, sh.geometry)[None]

    fn = jax.jit(sharding.loop_per_data_shard(per_shard, mesh))
    prompt = lambda dtype: jax.ShapeDtypeStruct((sh.prompts * sh.shards, s.prompt_len), dtype, sharding=rows)
    uids = jax.ShapeDtypeStruct((sh.prompts * sh.shards,), jnp.int32, sharding=rows)
    return programs.Lowerable(
        _InMesh(fn, mesh),
        (sharding.abstract_sharded_params(m, mesh), prompt(jnp.int32), prompt(bool), uids, _scalar(mesh)),
        (),
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


_ITEMSIZE = {
    **dict.fromkeys(("pred", "s8", "u8"), 1),
    **dict.fromkeys(("bf16", "f16", "s16", "u16"), 2),
    **dict.fromkeys(("f32", "s32", "u32"), 4),
    **dict.fromkeys(("f64", "s64", "u64"), 8),
}
_ARRAY = re.compile(r"\b(" + "|".join(_ITEMSIZE) + r")\[([\d,]*)\](\{[^}]*\})?")
_INSTRUCTION = re.compile(r"^\s*(ROOT )?%([\w.\-]+) = (.*?) ([a-z][\w\-]*)\(([^)]*)\)(.*)$")
_FREE = {  # no bytes of their own: views, control flow (its bodies are counted), ends of async ops
    *("parameter", "get-tuple-element", "tuple", "bitcast", "constant", "iota", "while"),
    *("conditional", "after-all", "partition-id", "replica-id", "opt-barrier", "copy-done"),
    *("all-gather-done", "all-reduce-done", "collective-permute-done"),
}
_IN_PLACE, _READS_PART = {"scatter", "dynamic-update-slice"}, {"gather", "dynamic-slice"}


def _hbm(shape: str) -> int:
    """Bytes of the arrays of an HLO shape that lie in HBM (those in another memory space, `S(n)`
    in their layout, such as VMEM, left out)."""
    total = 0
    for dtype, dims, layout in _ARRAY.findall(shape):
        if not re.search(r"S\(\d+\)", layout):
            total += math.prod(int(d) for d in dims.split(",") if d) * _ITEMSIZE[dtype]
    return total


class _Op(NamedTuple):
    shape: str
    op: str
    operands: list
    attributes: str
    parameter: int | None  # a parameter's number


def _computations(hlo: str) -> dict[str, tuple[dict[str, _Op], str]]:
    """{computation: ({instruction: _Op}, its root)} of an HLO module's text."""
    comps = {}
    for block in re.split(r"\n(?=\S)", hlo):
        header = re.match(r"(?:ENTRY )?%([\w.\-]+) ", block)
        if not header:
            continue
        body, root = {}, ""
        for line in block.split("\n")[1:]:
            m = _INSTRUCTION.match(line)
            if m:
                is_root, name, shape, op, args, attributes = m.groups()
                number = int(args) if op == "parameter" else None
                body[name] = _Op(shape, op, re.findall(r"%([\w.\-]+)", args), attributes, number)
                root = name if is_root else root
        comps[header.group(1)] = (body, root)
    return comps


def _through_bitcasts(body: dict[str, _Op], name: str) -> _Op:
    while body[name].op == "bitcast":
        name = body[name].operands[0]
    return body[name]


def _fusion_bytes(fused: tuple[dict[str, _Op], str], out: int, sizes: list[int]) -> int:
    """A fusion's HBM bytes: its result and operands, but an operand it only gathers or slices
    from, and the buffer its root updates in place (then its updates, read and written)."""
    body, root = fused
    part = {_through_bitcasts(body, x.operands[0]).parameter for x in body.values() if x.op in _READS_PART}
    kept = lambda skip: sum(s for i, s in enumerate(sizes) if i not in skip)
    top = _through_bitcasts(body, root)
    if top.op in _IN_PLACE:
        buffer = _through_bitcasts(body, top.operands[0]).parameter
        if buffer is not None:
            return 2 * kept(part | {buffer})
    return out + kept(part)


def hbm_bytes(hlo: str) -> int:
    """HBM bytes a compiled TPU program reads and writes, counted from its scheduled HLO text
    (`compiled.as_text()`): each instruction of the computations that run (the entry, loop bodies
    and branches; a loop's body once), its operands and result that lie in HBM, but
    - a fusion's operand that it only gathers or slices from, and the buffer a fusion's root
      updates in place (a scatter, a dynamic update slice): its result, or its updates read and
      written, count instead (`_fusion_bytes`; bare gathers and updates likewise);
    - an asynchronous copy (`copy-start`): its source read and its destination written where
      each lies in HBM (a prefetch into VMEM: the source once);
    - a Pallas kernel (`tpu_custom_call`): its result twice (the query it reads, the output it
      writes); what it fetches by DMA (the engine's pages) is counted by hand
      (`EngineCount.kernel_pairs`).
    XLA's cost analysis ("bytes accessed") counts a nested fusion's operands again and memory
    outside HBM: a chain of 8 dots over 259 MiB of bf16 weights on one v5p chip, 521 MiB by cost
    analysis, 295 MiB here (one weight prefetched into VMEM twice, the activations)."""
    comps = _computations(hlo)
    inner = set(re.findall(r"(?:calls|to_apply)=%([\w.\-]+)", hlo))
    shapes = {name: x.shape for body, _ in comps.values() for name, x in body.items()}
    total = 0
    for comp, (body, _) in comps.items():
        for x in body.values() if comp not in inner else ():
            sizes, out = [_hbm(shapes[o]) for o in x.operands], _hbm(x.shape)
            if x.op in _FREE:
                continue
            if x.op == "copy-start":  # (destination, source, context)
                total += sizes[0] + _hbm(_ARRAY.search(x.shape).group(0))
            elif x.op == "custom-call" and "tpu_custom_call" in x.attributes:
                total += 2 * out
            elif x.op == "fusion":
                called = re.search(r"calls=%([\w.\-]+)", x.attributes).group(1)
                total += _fusion_bytes(comps[called], out, sizes)
            elif x.op in _IN_PLACE:
                total += 2 * sum(sizes[1:])
            else:
                total += out + sum(sizes[1:] if x.op in _READS_PART else sizes)
    return total

"""The KV cache of a rollout micro-batch and the HBM bytes of each decoded token under the
trainer's FSDP layout and under a tensor-parallel rollout layout (`dapo_jax.aot`'s `decode`):
cost analysis of one fixed-batch decode step at 1 and 2 layers, extrapolated."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from dapo_jax import decoding, fixed_batch, model, programs, sharding
from dapo_jax.aot_report import GIB
from dapo_jax.chips import Chip


def _decode_step_bytes(cfg: model.ModelConfig, mesh, rows: int, slots: int, dtype) -> float:
    """HBM bytes one chip reads and writes in one decode step of `rows` rows over caches of
    `slots` slots, the weights in `dtype`, laid out by `RULES` on `mesh`: cost analysis of the
    step at 1 and 2 scanned layers, extrapolated linearly to `cfg.num_layers`."""
    measured = []
    for layers in (1, 2):
        m = model.Transformer(dataclasses.replace(cfg, num_layers=layers, scan_layers=True, remat=None))
        rep = sharding.replicated(mesh)
        cache_sh = jax.tree.map(
            lambda axes: sharding.logical_to_sharding(jax.sharding.PartitionSpec("layers", *axes), mesh),
            fixed_batch.cache_logical_axes(cfg),
            is_leaf=lambda x: isinstance(x, tuple) and all(isinstance(a, (str, type(None))) for a in x),
        )
        caches = sharding.with_shardings(
            jax.eval_shape(lambda m=m: model.init_cache(m.config, rows, slots)), cache_sh
        )
        fn = jax.jit(
            lambda p, t, pos, a, kv, m=m: decoding.decode_step(
                m, p, t, pos, a, kv, jnp.full((rows,), slots - 1)
            ),
            in_shardings=(sharding.param_shardings(m, mesh), rep, rep, rep, cache_sh),
        )
        args = (
            sharding.abstract_sharded_params(m, mesh, dtype),
            jax.ShapeDtypeStruct((rows,), jnp.int32),
            jax.ShapeDtypeStruct((rows,), jnp.int32),
            jax.ShapeDtypeStruct((rows, slots), bool),
            caches,
        )
        with sharding.activate(mesh):
            cost = fn.lower(*args).compile().cost_analysis()
        cost = cost[0] if isinstance(cost, list) else cost
        measured.append(float(cost["bytes accessed"]))
    per_layer = measured[1] - measured[0]
    return measured[0] + per_layer * (cfg.num_layers - 1)


def decode_layouts(cfg, c, mesh, devices, chip: Chip) -> list[dict]:
    """The KV cache, and the bytes per decoded token under the trainer's layout (its mesh, f32
    FSDP weights all-gathered every step) and a tensor-parallel rollout layout (bf16 weights
    over `tensor` chips only, replicated across data groups)."""
    s, new_tokens = programs.program_sizes(c, None, None), c.rollout.max_new_tokens
    rows, slots = s.rollout_prompts * s.group, s.prompt_len + new_tokens
    kv_bytes = 2 * cfg.num_layers * rows * cfg.num_kv_heads * slots * cfg.head_dim * 2
    n, tp = len(devices), mesh.shape["tensor"]
    tp_mesh = sharding.make_mesh({"data": -1, "fsdp": 1, "tensor": tp}, devices)
    weights = cfg.num_params()
    out = []
    for name, m, dtype, gathered in (
        ("trainer FSDP", mesh, cfg.weight_dtype, weights * cfg.weight_dtype.itemsize / tp),
        ("rollout TP", tp_mesh, jnp.bfloat16, 0.0),
    ):
        step = _decode_step_bytes(cfg, m, rows, slots, dtype)
        fsdp = m.shape["fsdp"]
        out.append(
            dict(
                layout=name,
                mesh=dict(m.shape),
                weights_per_chip_gib=(weights * np.dtype(dtype).itemsize / (tp * fsdp) / GIB),
                step_hbm_gib=step / GIB,
                hbm_bytes_per_token=step * n / rows,
                ici_gather_gib_per_step=gathered * (fsdp - 1) / fsdp / GIB,
                step_hbm_s=step / (chip.hbm_gbps * 1e9),
                decode_hbm_s=new_tokens * step / (chip.hbm_gbps * 1e9),
            )
        )
    print(
        f"KV cache (bf16) of {rows} rows x {slots} slots: {kv_bytes / GIB:.1f} GiB, "
        f"{kv_bytes / n / GIB:.2f} GiB per chip",
        flush=True,
    )
    for r in out:
        print(
            f"decode {r['layout']:12s} mesh {r['mesh']}  weights {r['weights_per_chip_gib']:.2f}"
            f" GiB/chip  HBM {r['step_hbm_gib']:.2f} GiB/chip/step ({r['step_hbm_s'] * 1e3:.1f}"
            f" ms, {r['decode_hbm_s']:.0f} s for N steps)  "
            f"{r['hbm_bytes_per_token'] / 2**20:.1f} MiB HBM per decoded token  "
            f"all-gather {r['ici_gather_gib_per_step']:.2f} GiB/chip/step",
            flush=True,
        )
    cheaper = min(out, key=lambda r: r["step_hbm_gib"] + r["ici_gather_gib_per_step"])
    print(f"cheaper per decoded token: {cheaper['layout']}", flush=True)
    return [dict(r, kv_cache_gib=kv_bytes / GIB) for r in out]

"""Compile a run's programs for a TPU slice on this machine, and say whether they fit.

    python -m dapo_jax.aot --config=configs/dapo.py:qwen2_5_32b --topology=v5p-128
    python -m dapo_jax.aot --config=configs/dapo.py:tiny --topology=cpu:8 --hbm_gib=0.01

The run's meshes and programs are built by `programs.build`, as a run builds them, over abstract
devices (`jax.experimental.topologies`, which needs libtpu: the `tpu` extra; `cpu:N` takes N host
devices instead): the train step, the log-prob pass, the rollout's sampler program (one rollout
micro-batch, on the rollout's mesh, in its dtypes), the evaluation's (one eval micro-batch) and the
rollout weights' cast are lowered on their abstract inputs (`programs.abstract_inputs`:
ShapeDtypeStructs with shardings) and compiled by the real compiler: no weight is read or
allocated. `train` and `logprobs` are compiled at their most packed rows (every response at
L_max, one a row), `train_packed` and `logprobs_packed` on the packed rows of a synthetic batch
at DAPO's lengths (`dapo_lengths`). Per program it prints
per-chip argument / output / temporary memory, plus what stays resident beside it (the train
state: params and AdamW moments; the rollout weights' copy during the samplers' programs), against
the chip's HBM, FLOPs and the time they imply at the chip's peak; then the KV cache and the HBM
bytes each decoded token reads under the trainer's FSDP layout and under a tensor-parallel rollout
layout. `engine` compiles what `rollout.paged` runs on the rollout mesh (the whole rollout of a
micro-batch, its prefill, and one decode step as its own program) and sets the step's HBM bytes
against a count by hand (`engine_cost`) at DAPO's lengths, with the tokens/s per chip they imply.
It exits 1 with a one-line message when a program does not fit.

FLOPs. XLA's cost analysis counts a loop body once (the scanned layers, the micro-batch scan, the
decode loop), so the FLOPs and times below are the model's, counted by hand (`model_flops`); the
bytes per decoded token come from cost analysis of one decode step at 1 and 2 layers, extrapolated.
The engine's bytes are counted from the compiled programs' HLO instead (`engine_cost.hbm_bytes`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from ml_collections import config_flags

from dapo_jax import (
    config_checks,
    engine_cost,
    hf_model_config,
    model,
    packing,
    paged_attention,
    programs,
    run,
    sampler,
    sharding,
    sizes,
    train_step,
)
from dapo_jax.errors import ConfigError

GIB = 2**30


class Chip(NamedTuple):
    hbm_gib: float
    peak_tflops: float  # bf16
    hbm_gbps: float


CHIPS = {
    "v5p": Chip(95, 459, 2765),
    "v6e": Chip(32, 918, 1640),
    "v5e": Chip(16, 197, 819),
    "cpu": Chip(16, 1, 50),
}

# config.json of the models the shipped configs name, for when the checkpoint is not on this
# machine (a model folder's own config.json wins). Values from the models' Hub config files.
_QWEN = dict(
    hidden_act="silu",
    rms_norm_eps=1e-6,
    rope_theta=1e6,
    tie_word_embeddings=False,
    max_position_embeddings=131072,
)
KNOWN_MODELS = {
    "Qwen2.5-32B": dict(
        _QWEN,
        architectures=["Qwen2ForCausalLM"],
        model_type="qwen2",
        vocab_size=152064,
        hidden_size=5120,
        intermediate_size=27648,
        num_hidden_layers=64,
        num_attention_heads=40,
        num_key_value_heads=8,
        rms_norm_eps=1e-5,
    ),
    "Qwen2.5-7B": dict(
        _QWEN,
        architectures=["Qwen2ForCausalLM"],
        model_type="qwen2",
        vocab_size=152064,
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
    ),
    "Qwen3-8B-Base": dict(
        _QWEN,
        architectures=["Qwen3ForCausalLM"],
        model_type="qwen3",
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=32768,
    ),
}


def topology_devices(name: str):
    """`(chip kind, devices)` of a topology name: v5p-N counts TensorCores (2 per chip) as
    Cloud TPU names slices, v6e-N and v5e-N count chips; cpu:N takes N host devices."""
    kind, _, size = name.replace(":", "-").partition("-")
    if kind not in CHIPS or not size.isdigit() or int(size) < 1:
        raise ConfigError(f"--topology {name!r} is not v5p-N, v6e-N, v5e-N or cpu:N")
    n = int(size)
    if kind == "cpu":
        devices = jax.devices("cpu")
        if len(devices) < n:
            raise ConfigError(
                f"--topology {name}: {len(devices)} host devices; run with "
                f"XLA_FLAGS=--xla_force_host_platform_device_count={n}"
            )
        return kind, devices[:n]
    chips = n // 2 if kind == "v5p" else n
    shape = _torus(chips, 3 if kind == "v5p" else 2, name)
    from jax.experimental import topologies  # noqa: PLC0415 - needs libtpu only here

    try:
        topo = topologies.get_topology_desc(
            platform="tpu",
            topology_name=f"{kind}:{'x'.join(map(str, shape))}",
            chip_config_name="default",
            chips_per_host_bounds=(2, 2, 1),
            num_slices=1,
        )
    except Exception as e:  # noqa: BLE001 - no libtpu, or a shape libtpu does not know
        raise ConfigError(
            f"--topology {name}: no abstract TPU devices ({type(e).__name__}: "
            f"{str(e)[:160]}); install the tpu extra (jax[tpu]) or use "
            "cpu:N"
        ) from None
    return kind, topo.devices


def _torus(chips: int, dims: int, name: str) -> tuple[int, ...]:
    """The slice shape of `chips` chips: from 2x2(x1), the smallest axis doubled until full."""
    if chips < 4 or chips & (chips - 1):
        raise ConfigError(f"--topology {name}: {chips} chips; use a power of two >= 4 chips")
    shape = [2, 2] + [1] * (dims - 2)
    while math.prod(shape) < chips:
        i = len(shape) - 1 - int(np.argmin(shape[::-1]))
        shape[i] *= 2
    return tuple(sorted(shape))


def model_config(c) -> model.ModelConfig:
    """The run's ModelConfig: the model folder's config.json, or `KNOWN_MODELS` by folder name."""
    path = os.path.join(c.model.path, "config.json")
    if os.path.isfile(path):
        hf = hf_model_config.read_hf_config(c.model.path)
    elif os.path.basename(c.model.path.rstrip("/")) in KNOWN_MODELS:
        hf = KNOWN_MODELS[os.path.basename(c.model.path.rstrip("/"))]
    else:
        raise ConfigError(
            f"model.path {c.model.path!r} has no config.json here and is not one "
            f"of {sorted(KNOWN_MODELS)}: copy its config.json there"
        )
    return hf_model_config.config_from_hf(hf, source=path, **run.model_numerics(c))


def model_flops(cfg: model.ModelConfig, tokens: int, context: float) -> float:
    """Forward FLOPs of `tokens` tokens each attending over `context` keys: 2 per weight
    (embedding lookup excluded) plus q.k and p.v, 4 x heads x head_dim per key per layer."""
    weights = cfg.num_params() - cfg.vocab_size * cfg.hidden_size * (0 if cfg.tie_word_embeddings else 1)
    attention = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * context
    return tokens * (2 * weights + attention)


def _report(name, compiled, chip: Chip, hbm_gib: float, flops: float, resident: float, seconds):
    """One program's row: its per-chip memory (arguments, outputs, temporaries, less the outputs
    aliased to donated arguments) plus `resident` bytes held beside it, against the chip's HBM."""
    m = compiled.memory_analysis()
    total = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes
    row = dict(
        program=name,
        args_gib=m.argument_size_in_bytes / GIB,
        out_gib=m.output_size_in_bytes / GIB,
        temp_gib=m.temp_size_in_bytes / GIB,
        alias_gib=m.alias_size_in_bytes / GIB,
        resident_gib=resident / GIB,
        total_gib=(total + resident) / GIB,
        hbm_gib=hbm_gib,
        tflops_per_chip=flops / 1e12,
        flop_s=flops / (chip.peak_tflops * 1e12),
        compile_s=seconds[0],
        compile_cpu_s=seconds[1],
    )
    print(
        f"{name:9s} args {row['args_gib']:7.2f}  out {row['out_gib']:7.2f}  temp "
        f"{row['temp_gib']:7.2f}  alias {row['alias_gib']:7.2f}  resident {row['resident_gib']:6.2f}  "
        f"total {row['total_gib']:7.2f} / {hbm_gib:g} GiB  {row['tflops_per_chip']:10.1f} TFLOP/chip  "
        f"{row['flop_s']:8.2f} s at peak  (compiled in {seconds[0]:.0f} s, {seconds[1]:.0f} CPU-s)",
        flush=True,
    )
    return row


def _compile(lowered_fn):
    """The compiled program and (wall, CPU) seconds of lowering + compiling it: the CPU seconds of
    this process bound the wall time on an idle machine when other jobs share the cores."""
    start, cpu = time.perf_counter(), time.process_time()
    compiled = lowered_fn().compile()
    return compiled, (time.perf_counter() - start, time.process_time() - cpu)


def program_flops(cfg: model.ModelConfig, c) -> dict[str, float]:
    """Each program's FLOPs over the whole slice, counted by hand: the train step's forward,
    backward (2x) and remat's second forward over a mini-batch; the log-prob pass's forward over
    a rollout batch; a sampler's prefill of its prompts and its decode of every row to L_max."""
    s = programs.program_sizes(c)
    passes = 4 if cfg.remat else 3

    def sampler(prompts, n):
        l, new = s.prompt_len, c.rollout.max_new_tokens
        return model_flops(cfg, prompts * l, l / 2) + model_flops(cfg, prompts * n * new, l + new / 2)

    return {
        "train": passes * model_flops(cfg, s.train_rows * s.length, s.length / 2),
        "logprobs": model_flops(cfg, s.logprob_rows * s.length, s.length / 2),
        "rollout": sampler(s.rollout_prompts, s.group),
        "eval": sampler(s.eval_prompts, s.eval_samples),
        "cast": 0.0,
    }


def _params(m, mesh, dtype):
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, dtype), sharding.abstract_params(m))
    shardings = sharding.param_shardings(m, mesh)
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)


def _decode_step_bytes(cfg: model.ModelConfig, mesh, rows: int, slots: int, dtype) -> float:
    """HBM bytes one chip reads and writes in one decode step of `rows` rows over caches of
    `slots` slots, the weights in `dtype`, laid out by `RULES` on `mesh`: cost analysis of the
    step at 1 and 2 scanned layers, extrapolated linearly to `cfg.num_layers`."""
    measured = []
    for layers in (1, 2):
        m = model.Transformer(dataclasses.replace(cfg, num_layers=layers, scan_layers=True, remat=False))
        rep = sharding.replicated(mesh)
        cache_sh = jax.tree.map(
            lambda axes: sharding.logical_to_sharding(jax.sharding.PartitionSpec("layers", *axes), mesh),
            sampler.cache_logical_axes(cfg),
            is_leaf=lambda x: isinstance(x, tuple) and all(isinstance(a, (str, type(None))) for a in x),
        )
        caches = jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
            jax.eval_shape(lambda m=m: model.init_cache(m.config, rows, slots)),
            cache_sh,
        )
        fn = jax.jit(
            lambda p, t, pos, a, kv, m=m: sampler.decode_step(
                m, p, t, pos, a, kv, jnp.full((rows,), slots - 1)
            ),
            in_shardings=(sharding.param_shardings(m, mesh), rep, rep, rep, cache_sh),
        )
        args = (
            _params(m, mesh, dtype),
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
    s, new_tokens = programs.program_sizes(c), c.rollout.max_new_tokens
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


def _bytes(compiled) -> float:
    """HBM bytes per chip of a compiled program, counted from its HLO (`engine_cost.hbm_bytes`:
    XLA's cost analysis counts nested fusions' operands again, and VMEM)."""
    return float(engine_cost.hbm_bytes(compiled.as_text()))


def engine_rows(c, cfg: model.ModelConfig, devices, chip: Chip, hbm_gib: float) -> list[dict]:
    """The programs `rollout.paged` runs, compiled on the rollout mesh, and their HBM bytes per
    decode step against the hand count (`engine_cost.engine_count`) at DAPO's lengths
    (`dapo_rows`), with the tokens/s per chip each implies:
    - `engine`: the whole rollout of one micro-batch (each data shard's prefill and decode loop),
      its memory with the train state resident; `engine_prefill`: the prefill alone. The first's
      bytes less the second's are the decode loop's body with its loops' bodies (the scanned
      layers, the attention's blocks) counted once: a lower bound of a step's bytes.
    - `engine_step`: one decode step's bytes (`_step_bytes`) against the roofline; where the model
      runs the Pallas kernel (a TPU mesh), plus the pages the kernel fetches
      (`EngineCount.kernel_pairs`: its DMAs, which no count of the compiled program sees)."""
    paged, p, sh, count, response_B = _engine_count(c, cfg, devices)
    s, geo, tensor = programs.program_sizes(paged), sh.geometry, p.rollout_mesh.shape["tensor"]
    flops = model_flops(cfg, s.rollout_prompts * s.prompt_len, s.prompt_len / 2)
    decode_flops = model_flops(cfg, count.tokens * sh.shards, count.pairs * geo.page_size / count.tokens)
    rows, whole = _engine_programs(p, paged, devices, chip, hbm_gib, flops, decode_flops)
    step, pair, kernel_layer = _step_bytes(p, paged, devices, geo.slots)
    kernel = paged_attention.uses_kernel(p.rollout_mesh)
    compiled_step = _compiled_step(step, pair, kernel, count, cfg.num_layers, geo.slots)
    body = whole.get("engine", math.nan) - whole.get("engine_prefill", math.nan)
    roofline = count.bytes_per_step
    seconds_of = lambda per_step: count.steps * per_step / (chip.hbm_gbps * 1e9)
    batches = paged.filter.gen_batch_prompts / s.rollout_prompts  # micro-batches a generation batch
    row = dict(
        program="engine_step",
        slots=geo.slots,
        pool_pages=geo.pool_pages,
        steps=count.steps,
        tokens=count.tokens,
        mean_response=float(response_B.mean()),
        step_bytes_1_2_layers=step,
        pair_bytes=pair,
        page_bytes=count.page_bytes / cfg.num_layers,
        pairs_per_step=count.pairs / count.steps,  # per layer, the shard's rows together
        compiled_step_gib=compiled_step / GIB,
        loop_body_gib=body / GIB,
        roofline_step_gib=roofline / GIB,
        roofline_weights_gib=count.weight_bytes / GIB,
        ratio=compiled_step / roofline,
        loop_body_ratio=body / roofline,
        kernel_layer_bytes=kernel_layer,
        attention="kernel" if kernel else "pure",
        kernel_pairs_per_step=count.kernel_pairs / count.steps,
        tokens_per_s_chip=count.tokens / tensor / seconds_of(compiled_step),
        roofline_tokens_per_s_chip=count.tokens / tensor / seconds_of(roofline),
        gen_batch_hours=batches * seconds_of(compiled_step) / 3600,
        roofline_gen_batch_hours=batches * seconds_of(roofline) / 3600,
        total_gib=0.0,
        hbm_gib=hbm_gib,
    )
    print(_engine_step_text(row, geo), flush=True)
    return [*rows, row]


def _engine_count(c, cfg: model.ModelConfig, devices):
    """`(config, programs, shard, count, response_B)`: `c` with `rollout.paged` on, its programs
    on `devices`, a data shard's sizes (`engine_cost.shard`) and the hand count of its decode at
    DAPO's lengths (`dapo_rows`, `engine_cost.engine_count`)."""
    paged = c.copy_and_resolve_references()
    paged.rollout.paged = True
    p = programs.build(paged, cfg, (0,), 0, devices)
    sh, s = engine_cost.shard(p, paged), programs.program_sizes(paged)
    geo, tensor = sh.geometry, p.rollout_mesh.shape["tensor"]
    prompt_B, response_B = dapo_rows(geo.rows, s.prompt_len, paged.rollout.max_new_tokens)
    block = min(paged_attention.KERNEL_BLOCK_PAGES, geo.table_pages)
    count = engine_cost.engine_count(
        p.rollout_model.config, tensor, prompt_B, response_B, geo.page_size, geo.slots, block
    )
    print(f"engine per data shard: {sh.prompts} prompts, {geo}", flush=True)
    return paged, p, sh, count, response_B


def _compiled_step(step, pair: float, kernel: bool, count, layers: int, slots: int) -> float:
    """A decode step's HBM bytes from `_step_bytes` (`step`: 1 and 2 layers, extrapolated to
    `layers`), plus what its one compiled attention block leaves out: with the Pallas kernel the
    pages it fetches by DMA (`count.kernel_pairs`, which the program's HLO does not show), with the
    pure path the mean step's (row, page) pairs past the block's RUN_PAGES x S, at `pair` bytes."""
    compiled = step[0] + (step[1] - step[0]) * (layers - 1)
    if kernel:
        return compiled + count.kernel_pairs * count.page_bytes / count.steps
    pairs_per_step = count.pairs / count.steps
    return compiled + layers * pair * (pairs_per_step - paged_attention.RUN_PAGES * slots)


def _engine_programs(p, paged, devices, chip: Chip, hbm_gib: float, flops: float, decode_flops: float):
    """The `engine` and `engine_prefill` rows (a program the compiler cannot fit in HBM: a row
    that does not fit) and {name: HBM bytes accessed} of those that compiled."""
    resident = programs.per_chip_bytes(programs.abstract_inputs(p, paged)["rollout"].resident)
    rows, whole = [], {}
    for name, (fn, args, _), f in (
        ("engine", programs.abstract_inputs(p, paged)["rollout"], flops + decode_flops),
        ("engine_prefill", engine_cost.prefill_program(p, paged), flops),
    ):
        try:
            compiled, seconds = _compile(lambda fn=fn, args=args: fn.lower(*args))
        except jax.errors.JaxRuntimeError as e:  # the compiler's own "does not fit"
            if "RESOURCE_EXHAUSTED" not in str(e):
                raise
            print(f"{name}: {str(e).splitlines()[0]}", flush=True)
            rows.append(dict(program=name, total_gib=math.inf, hbm_gib=hbm_gib, error=str(e).splitlines()[0]))
            continue
        rows.append(_report(name, compiled, chip, hbm_gib, f / len(devices), resident, seconds))
        whole[name] = _bytes(compiled)
    return rows, whole


def _step_bytes(p, paged, devices, slots: int) -> tuple[list[float], float, float]:
    """HBM bytes of one decode step of every shard's engine as its own program
    (`engine_cost.step_program`, layers unrolled) at 1 and 2 layers, which `engine_rows`
    extrapolates to the model's layers; of one (row, page) pair of the pure-JAX attention (one
    layer's `paged_decode_attention` on one chip at blocks of S and 2S pages), by which it scales
    the step's attention loop (one block of `RUN_PAGES` x S pages counted) to the mean step's
    pairs; and of the Pallas kernel's layer (compiled on TPU only; 0.0 elsewhere)."""
    step = []
    for layers in (1, 2):
        fn, args, _ = engine_cost.step_program(p, paged, layers)
        step.append(_bytes(_compile(lambda fn=fn, args=args: fn.lower(*args))[0]))
    attention = {}
    for blocks in (1, 2):
        for name, (fn, args, _) in engine_cost.attention_programs(p, paged, blocks * slots).items():
            if name == "pure" or (blocks == 1 and devices[0].platform == "tpu"):  # a TPU kernel
                attention[name, blocks] = _bytes(_compile(lambda fn=fn, args=args: fn.lower(*args))[0])
    pair = (attention["pure", 2] - attention["pure", 1]) / slots
    return step, pair, attention.get(("kernel", 1), 0.0)


def _engine_step_text(row: dict, geo) -> str:
    return (
        f"engine_step ({geo.slots} slots, {geo.pool_pages} pages of {geo.page_size} a shard; DAPO "
        f"lengths: mean response {row['mean_response']:.0f}, {row['steps']} steps) GiB/chip/step: "
        f"one step compiled {row['compiled_step_gib']:.2f} ({row['ratio']:.2f}x), the loop's body "
        f"(loops once) {row['loop_body_gib']:.2f} ({row['loop_body_ratio']:.2f}x), against the "
        f"roofline's {row['roofline_step_gib']:.2f} ({row['roofline_weights_gib']:.2f} of weights); "
        f"{row['tokens_per_s_chip']:.0f} tokens/s/chip (roofline {row['roofline_tokens_per_s_chip']:.0f});"
        f" a generation batch {row['gen_batch_hours']:.2f} h (roofline "
        f"{row['roofline_gen_batch_hours']:.2f} h). One layer's attention on one chip: pure JAX "
        f"{row['pair_bytes'] / 2**10:.1f} KiB per (row, page) pair "
        f"(a page: {row['page_bytes'] / 2**10:.1f} KiB), "
        f"{row['pairs_per_step']:.0f} pairs a step; the Pallas kernel "
        f"{row['kernel_layer_bytes'] / 2**20:.2f} MiB by its HLO (0: not compiled, no TPU), "
        f"{row['kernel_pairs_per_step']:.0f} pages fetched a step (its blocks). The model's "
        f"attention: {row['attention']}"
    )


def check_fit(rows: list[dict]) -> str | None:
    """The one-line complaint about the first program that does not fit, or None."""
    for r in rows:
        if "error" in r:
            return f"{r['program']}: {r['error']}"
        if r["total_gib"] > r["hbm_gib"]:
            return (
                f"{r['program']} needs {r['total_gib']:.2f} GiB per chip, "
                f"{r['total_gib'] - r['hbm_gib']:.2f} GiB more than the {r['hbm_gib']:g} GiB "
                "it has: more chips, a smaller micro-batch or a longer chunked pass"
            )
    return None


def dapo_rows(rows: int, prompt_len: int, new_tokens: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """`(prompt_B, response_B)`: tokens of `rows` synthetic rows at DAPO's length distribution:
    4% of responses at L_max, the others exponential with mean 0.17 L_max (below L_max), a mean
    response of ~0.2 L_max (4.1k of 20,480); prompts uniform in [L / 16, L / 8] of the longest
    prompt bucket L (DAPO-Math's prompts: a few hundred tokens of 2,048)."""
    rng = np.random.default_rng(seed)
    response_B = np.minimum(rng.exponential(0.17 * new_tokens, rows).astype(int) + 1, new_tokens - 1)
    response_B[rng.random(rows) < 0.04] = new_tokens
    return rng.integers(prompt_len // 16, prompt_len // 8 + 1, rows), response_B


def dapo_lengths(rows: int, prompt_len: int, new_tokens: int, seed: int = 0) -> np.ndarray:
    """Real tokens (prompt + response) of `dapo_rows`."""
    return sum(dapo_rows(rows, prompt_len, new_tokens, seed))


def packed_shapes(c, s: programs.ProgramSizes) -> tuple[int, int]:
    """`(train rows, log-prob rows)` of the packed programs on `dapo_lengths`."""
    lengths = dapo_lengths(s.logprob_rows, s.prompt_len, c.rollout.max_new_tokens)
    micro, k = c.train.micro_batch_size, s.logprob_rows // s.train_rows
    train = packing.packed_rows(lengths[: s.train_rows], s.length, 1, micro)
    return train, k * packing.packed_rows(lengths, s.length, k, micro)


def packed_inputs(p: programs.Programs, c, cfg: model.ModelConfig) -> dict:
    """`{name: (Lowerable, FLOPs)}` of `train_packed` and `logprobs_packed`: the run's train step
    and log-prob pass on the packed rows of a `dapo_lengths` batch."""
    s, step, logprobs = programs.program_sizes(c), p.train_step, p.logprobs_fn
    train_rows, logprob_rows = packed_shapes(c, s)

    def rows(n, dtype):
        return jax.ShapeDtypeStruct((n, s.length), dtype, sharding=sharding.batch_sharding(p.mesh, 2))

    dtypes = (jnp.int32, jnp.int32, bool, jnp.float32, jnp.float32)  # segment ids, A_i per token
    batch = train_step.Batch(*(rows(train_rows, d) for d in dtypes), None)
    state, passes = p.abstract_state(), 4 if cfg.remat else 3
    print(f"packed: {train_rows} rows a mini-batch, {logprob_rows} a rollout batch", flush=True)
    tokens = rows(logprob_rows, jnp.int32)
    return {
        "train_packed": (
            programs.Lowerable(step, (state, batch), ()),
            passes * model_flops(cfg, train_rows * s.length, s.length / 2),
        ),
        "logprobs_packed": (
            programs.Lowerable(logprobs, (state.params, tokens, tokens), (state.opt_state,)),
            model_flops(cfg, logprob_rows * s.length, s.length / 2),
        ),
    }


PROGRAMS = ("train", "logprobs", "rollout", "eval", "cast", "train_packed", "logprobs_packed")


def analyse(c, topology: str, hbm_gib: float | None, names) -> tuple[list[dict], str | None]:
    """Compile the run's programs `names` (of `PROGRAMS`, and "decode": the layouts' bytes per
    decoded token) of the config `c` for `topology`, one at a time, as `programs.build` makes
    them for a run; print and return the rows, and the complaint of `check_fit`."""
    config_checks.check_ranges(c)
    unknown = sorted(set(names) - {*PROGRAMS, "decode", "engine"})
    if unknown:
        raise ConfigError(f"--programs: {unknown} not among {[*PROGRAMS, 'decode', 'engine']}")
    kind, devices = topology_devices(topology)
    sizes.check_batch_sizes(c, len(devices))  # the batch keys against this slice's chips
    chip = CHIPS[kind]
    hbm_gib = chip.hbm_gib if hbm_gib is None else hbm_gib
    cfg = model_config(c)
    p = programs.build(c, cfg, (0,), 0, devices)
    print(
        f"{topology}: {len(devices)} chips, mesh {dict(p.mesh.shape)}, rollout mesh "
        f"{dict(p.rollout_mesh.shape)} in {p.rollout_model.config.param_dtype}, "
        f"{cfg.num_params() / 1e9:.2f}B params, compute {cfg.dtype}, {programs.program_sizes(c)}",
        flush=True,
    )
    inputs, flops = programs.abstract_inputs(p, c), program_flops(cfg, c)
    if {"train_packed", "logprobs_packed"} & set(names):
        for name, (lowerable, count) in packed_inputs(p, c, cfg).items():
            inputs[name], flops[name] = lowerable, count
    rows = []
    for name in (n for n in PROGRAMS if n in names and n in inputs):
        fn, args, resident = inputs[name]
        compiled, seconds = _compile(lambda fn=fn, args=args: fn.lower(*args))
        resident = programs.per_chip_bytes(resident)
        rows.append(_report(name, compiled, chip, hbm_gib, flops[name] / len(devices), resident, seconds))
    if "decode" in names:
        rows_decode = decode_layouts(cfg, c, p.mesh, devices, chip)
        rows.append(dict(program="decode", layouts=rows_decode, total_gib=0.0, hbm_gib=hbm_gib))
    if "engine" in names:
        rows += engine_rows(c, cfg, devices, chip, hbm_gib)
    return rows, check_fit(rows)


def _define_flags():
    """The command's flags, defined when it runs (train and evaluate define --config too)."""
    config_flags.DEFINE_config_file("config", None, "configs/FILE.py:VARIANT", lock_config=False)
    flags.DEFINE_string(
        "topology",
        "v5p-128",
        "v5p-N (N TensorCores), v6e-N or v5e-N (N chips), or cpu:N (N host devices, no libtpu)",
    )
    flags.DEFINE_float("hbm_gib", None, "per-chip memory to check against (default: the chip's)")
    flags.DEFINE_list(
        "programs",
        "train,logprobs,rollout,eval,cast,decode",
        f"which programs to compile, of {[*PROGRAMS, 'decode', 'engine']}",
    )


def main(argv):
    del argv
    f = flags.FLAGS
    try:
        rows, complaint = analyse(f.config, f.topology, f.hbm_gib, f.programs)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    print(json.dumps(rows, default=float))
    if complaint:
        print(f"does not fit: {complaint}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    _define_flags()
    flags.mark_flags_as_required(["config"])
    app.run(main)

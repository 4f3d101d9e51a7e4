"""The rollout engine's programs (`cpu_variants` False) compiled on the rollout mesh, and their HBM bytes
per decode step against a count by hand at DAPO's lengths (`dapo_jax.aot`'s `engine`)."""

from __future__ import annotations

import math

import jax

from dapo_jax import engine_cost, model, paged_attention, programs
from dapo_jax.aot_report import GIB, compile_timed, hlo_bytes, model_flops, report_row
from dapo_jax.chips import Chip
from dapo_jax.dapo_lengths import dapo_rows


def engine_rows(c, cfg: model.ModelConfig, devices, chip: Chip, hbm_gib: float) -> list[dict]:
    """The programs the engine runs, compiled on the rollout mesh, and their HBM bytes per
    decode step against the hand count (`engine_cost.engine_count`) at DAPO's lengths
    (`dapo_rows`), with the tokens/s per chip each implies:
    - `engine`: the whole rollout of one micro-batch (each data shard's prefill and decode loop),
      its memory with the train state resident; `engine_prefill`: the prefill alone. The first's
      bytes less the second's are the decode loop's body with its loops' bodies (the scanned
      layers, the attention's blocks) counted once: a lower bound of a step's bytes.
    - `engine_step`: one decode step's bytes (`_step_bytes`) against the roofline; where the model
      runs the Pallas kernel (a TPU mesh), plus the pages the kernel fetches
      (`EngineCount.kernel_pairs`: its DMAs, which no count of the compiled program sees)."""
    paged, p, sh, count, response_B = _engine_count(c, cfg, devices, hbm_gib)
    s, geo, tensor = p.sizes, sh.geometry, p.rollout_mesh.shape["tensor"]
    flops = model_flops(cfg, s.rollout_prompts * s.prompt_len, s.prompt_len / 2)
    decode_flops = model_flops(cfg, count.tokens * sh.shards, count.pairs * geo.page_size / count.tokens)
    rows, whole = _engine_programs(p, paged, devices, chip, hbm_gib, flops, decode_flops)
    step, pair, kernel_layer = _step_bytes(p, paged, devices, geo.slots)
    kernel = paged_attention.uses_kernel(cfg.head_dim, p.rollout_mesh)
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


def _engine_count(c, cfg: model.ModelConfig, devices, hbm_gib: float):
    """`(config, programs, shard, count, response_B)`: `c` with the engine (`cpu_variants` off), its programs
    on `devices`, a data shard's sizes (`engine_cost.shard`) and the hand count of its decode at
    DAPO's lengths (`dapo_rows`, `engine_cost.engine_count`)."""
    paged = c.copy_and_resolve_references()
    paged.cpu_variants = False
    p = programs.build(paged, cfg, (0,), 0, devices, hbm_gib * GIB)
    sh, s = engine_cost.shard(p, paged), p.sizes
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
            compiled, seconds = compile_timed(fn, args)
        except jax.errors.JaxRuntimeError as e:  # the compiler's own "does not fit"
            if "RESOURCE_EXHAUSTED" not in str(e):
                raise
            print(f"{name}: {str(e).splitlines()[0]}", flush=True)
            rows.append(dict(program=name, total_gib=math.inf, hbm_gib=hbm_gib, error=str(e).splitlines()[0]))
            continue
        rows.append(report_row(name, compiled, chip, hbm_gib, f / len(devices), resident, seconds))
        whole[name] = hlo_bytes(compiled)
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
        step.append(hlo_bytes(compile_timed(fn, args)[0]))
    attention = {}
    for blocks in (1, 2):
        for name, (fn, args, _) in engine_cost.attention_programs(p, paged, blocks * slots).items():
            if name == "pure" or (blocks == 1 and devices[0].platform == "tpu"):  # a TPU kernel
                attention[name, blocks] = hlo_bytes(compile_timed(fn, args)[0])
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

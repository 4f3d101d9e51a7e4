"""What `dapo_jax.aot` reports of each compiled program: FLOPs counted by hand (XLA's cost analysis
counts a loop body once), its per-chip memory against the chip's HBM, the HBM bytes its HLO
reads (`engine_cost.hbm_bytes`), its compile time, and whether every program fits."""

from __future__ import annotations

import time

from dapo_jax import engine_cost, model, programs
from dapo_jax.chips import Chip

GIB = 2**30


def model_flops(cfg: model.ModelConfig, tokens: int, context: float) -> float:
    """Forward FLOPs of `tokens` tokens each attending over `context` keys: 2 per weight
    (embedding lookup excluded) plus q.k and p.v, 4 x heads x head_dim per key per layer."""
    weights = cfg.num_params() - cfg.vocab_size * cfg.hidden_size * (0 if cfg.tie_word_embeddings else 1)
    attention = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * context
    return tokens * (2 * weights + attention)


def program_flops(cfg: model.ModelConfig, c, s: programs.ProgramSizes) -> dict[str, float]:
    """Each program's FLOPs over the whole slice, counted by hand: the train step's forward,
    backward (2x) and remat's second forward over a mini-batch; the log-prob pass's forward over
    a rollout batch; a sampler's prefill of its prompts and its decode of every row to L_max,
    at the sizes `s`."""
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


def report_row(name, compiled, chip: Chip, hbm_gib: float, flops: float, resident: float, seconds):
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


def compile_timed(fn, args):
    """`fn` compiled for `args` and the (wall, CPU) seconds of lowering + compiling it: the CPU
    seconds of this process bound the wall time on an idle machine when other jobs share the cores."""
    start, cpu = time.perf_counter(), time.process_time()
    compiled = fn.lower(*args).compile()
    return compiled, (time.perf_counter() - start, time.process_time() - cpu)


def hlo_bytes(compiled) -> float:
    """HBM bytes per chip of a compiled program, counted from its HLO (`engine_cost.hbm_bytes`:
    XLA's cost analysis counts nested fusions' operands again, and VMEM)."""
    return float(engine_cost.hbm_bytes(compiled.as_text()))


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

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
at DAPO's lengths (`dapo_lengths`). Per program it prints per-chip argument / output /
temporary memory, plus what stays resident beside it (the train state: params and AdamW moments;
the rollout weights' copy during the samplers' programs), against the chip's HBM, FLOPs and the
time they imply at the chip's peak; then the KV cache and the HBM
bytes each decoded token reads under the trainer's FSDP layout and under a tensor-parallel rollout
layout. `engine` compiles what the engine (`cpu_variants` False) runs on the rollout mesh (the
whole rollout of a micro-batch, its prefill, and one decode step as its own program) and sets
the step's HBM bytes against a count by hand (`engine_cost`) at DAPO's lengths, with the
tokens/s per chip they imply. It exits 1 with a one-line message when a program does not fit.

FLOPs. XLA's cost analysis counts a loop body once (the scanned layers, the micro-batch scan, the
decode loop), so the FLOPs and times below are the model's, counted by hand (`aot_report.model_flops`);
the bytes per decoded token come from cost analysis of one decode step at 1 and 2 layers,
extrapolated (`aot_decode`). The engine's bytes are counted from the compiled programs' HLO instead
(`aot_engine`, `engine_cost.hbm_bytes`). The slice's chips and abstract devices come from `chips`,
the model's config.json from the checkpoint or `known_models`.
"""

from __future__ import annotations

import json
import sys

import jax
import jax.numpy as jnp
from absl import app, flags
from ml_collections import config_flags

from dapo_jax import config_checks, model, packing, programs, sharding, sizes, train_step
from dapo_jax.aot_decode import decode_layouts
from dapo_jax.aot_engine import engine_rows
from dapo_jax.aot_report import GIB, check_fit, compile_timed, model_flops, program_flops, report_row
from dapo_jax.chips import CHIPS, topology_devices
from dapo_jax.dapo_lengths import dapo_lengths
from dapo_jax.errors import ConfigError, one_line_errors
from dapo_jax.known_models import model_config


def packed_shapes(c, s: programs.ProgramSizes) -> tuple[int, int]:
    """`(train rows, log-prob rows)` of the packed programs on `dapo_lengths`."""
    lengths = dapo_lengths(s.logprob_rows, s.prompt_len, c.rollout.max_new_tokens)
    micro, k = c.train.micro_batch_size, s.logprob_rows // s.train_rows
    train = packing.packed_rows(lengths[: s.train_rows], s.length, 1, micro)
    return train, k * packing.packed_rows(lengths, s.length, k, micro)


def packed_inputs(p: programs.Programs, c, cfg: model.ModelConfig) -> dict:
    """`{name: (Lowerable, FLOPs)}` of `train_packed` and `logprobs_packed`: the run's train step
    and log-prob pass on the packed rows of a `dapo_lengths` batch."""
    s, step, logprobs = p.sizes, p.train_step, p.logprobs_fn
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
    p = programs.build(c, cfg, (0,), 0, devices, hbm_gib * GIB)
    print(
        f"{topology}: {len(devices)} chips, mesh {dict(p.mesh.shape)}, rollout mesh "
        f"{dict(p.rollout_mesh.shape)} in {p.rollout_model.config.param_dtype}, "
        f"{cfg.num_params() / 1e9:.2f}B params, compute {cfg.dtype}, {p.sizes}, the engine's slots "
        f"(engine_plan): {p.sampler.config.decode_slots} (eval {p.eval_sampler.config.decode_slots})",
        flush=True,
    )
    inputs, flops = programs.abstract_inputs(p, c), program_flops(cfg, c, p.sizes)
    if {"train_packed", "logprobs_packed"} & set(names):
        for name, (lowerable, count) in packed_inputs(p, c, cfg).items():
            inputs[name], flops[name] = lowerable, count
    rows = []
    for name in (n for n in PROGRAMS if n in names and n in inputs):
        fn, args, resident = inputs[name]
        compiled, seconds = compile_timed(fn, args)
        resident = programs.per_chip_bytes(resident)
        rows.append(report_row(name, compiled, chip, hbm_gib, flops[name] / len(devices), resident, seconds))
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
    with one_line_errors():
        rows, complaint = analyse(f.config, f.topology, f.hbm_gib, f.programs)
    print(json.dumps(rows, default=float))
    if complaint:
        print(f"does not fit: {complaint}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    _define_flags()
    flags.mark_flags_as_required(["config"])
    app.run(main)

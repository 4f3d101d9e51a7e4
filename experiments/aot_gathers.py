"""Which dtype the update's FSDP collectives move per chip (AOT): the question of issue 37's
"bf16 gathers" (cast the f32 params to bf16 once per mini-batch, before the all-gathers).

    ALLOW_MULTIPLE_LIBTPU_LOAD=1 PYTHONPATH=. /work/tpu-venv/bin/python experiments/aot_gathers.py

A small Qwen2-shaped model (scanned layers, remat, bf16 compute, f32 params) is compiled for the
abstract chips of v5p-128 (fsdp 8 x tensor 8, `dapo_jax.chips.topology_devices`), its train step on
one mini-batch of 2 micro-batches; the compiled HLO's all-gather, reduce-scatter and all-reduce
results are summed by dtype (a loop body counted once, as XLA's own cost analysis does).
Measured (experiments/README.md): XLA already moves each weight's convert to bf16 before its
all-gather (and the weight gradients' all-reduce is bf16 too, the dW dot's dtype), so a cast of
the params before the step moved the same bytes and was not kept.
"""

from __future__ import annotations

import collections
import re

import jax
import jax.numpy as jnp

from dapo_jax import chips, model, sharding
from dapo_jax import train_step as ts

CFG = model.ModelConfig(
    vocab_size=8192,
    hidden_size=1024,
    intermediate_size=2816,
    num_layers=4,
    num_heads=16,
    num_kv_heads=8,
    head_dim=64,
    qkv_bias=True,
    remat="nothing_saveable",
    scan_layers=True,
)
ROWS, T, MICRO = 32, 2048, 2
_OP = re.compile(r"= \(?([a-z0-9]+)\[([0-9,]*)\][^=]*? (all-gather|reduce-scatter|all-reduce)(-start)?\(")
_BYTES = {"f32": 4, "bf16": 2, "s32": 4, "pred": 1, "f16": 2}


def collective_bytes(hlo: str) -> dict:
    """`{(op, dtype): bytes}` of the collectives' results in a compiled HLO text."""
    out = collections.Counter()
    for dtype, dims, op, _ in _OP.findall(hlo):
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        out[(op, dtype)] += n * _BYTES.get(dtype, 4)
    return dict(out)


def main():
    _, devices = chips.topology_devices("v5p-128")
    mesh = sharding.make_mesh({"data": 1, "fsdp": -1, "tensor": 8}, devices)
    m = model.Transformer(CFG)
    schedule = ts.learning_rate_schedule(1e-6, 0, "constant")
    opt = ts.make_optimizer(schedule, weight_decay=0.1, grad_clip=1.0)
    abstract = jax.eval_shape(
        lambda p: ts.TrainState(jnp.zeros((), jnp.int32), p, opt.init(p)), sharding.abstract_params(m)
    )
    state_sh = ts.state_shardings(m, opt, mesh)
    state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, state_sh)
    rows = lambda dt, shape=(ROWS, T): jax.ShapeDtypeStruct(
        shape, dt, sharding=sharding.batch_sharding(mesh, len(shape))
    )
    batch = ts.Batch(
        rows(jnp.int32), rows(bool), rows(bool), rows(jnp.float32, (ROWS,)), rows(jnp.float32), None
    )
    loss_cfg = ts.LossConfig(clip_ratio_c=10.0, temperature=1.0)
    step = ts.make_train_step(m, opt, schedule, loss_cfg, mesh, ROWS // MICRO)
    totals = collective_bytes(step.lower(state, batch).compile().as_text())
    head = f"{CFG.num_params() / 1e6:.0f}M params, compute {CFG.dtype}, params {CFG.param_dtype}"
    print(f"{head}, v5p-128 fsdp 8 x tensor 8:")
    for (op, dtype), b in sorted(totals.items()):
        print(f"  {op} {dtype}: {b / 2**20:.1f} MiB per chip")


if __name__ == "__main__":
    main()

"""The RL update of the reference workload, before and after each change of issues 18 and 37, one process.

    PYTHONPATH=. python experiments/bench_update.py [--reps 5] [--variants base,detached,...]
    PYTHONPATH=. python experiments/bench_update.py --mix longtail --variants micro4,packed16,...

Workload: the peer benchmark's random Qwen2 of 1.02M parameters (experiments/peers/workload.py:
hidden 128, 5 layers, 4 query and 2 KV heads of 32, MLP 384, 128-token vocabulary, q/k/v bias,
untied head), 8 prompts x G = 8 = 64 rows, left-padded prompts of 20-32 tokens in 32 columns,
responses of 1-64 tokens (uniform) in 64 columns: T = 96. One update = log pi_old (when
recomputed) + one jitted, donated AdamW step.
Each variant toggles one setting against `base` (recompute, float32, 1 micro-batch):
    detached   loss.old_logp "detached": no log pi_old forward pass (one update per rollout batch)
    sampler    loss.old_logp "sampler": the same, the sampler's log-probs given instead
    micro2/4   2 or 4 micro-batches of the gradient accumulation scan
    bf16       model.dtype bfloat16 (f32 accumulation, f32 params and optimizer)
    best       detached + 2 micro-batches + bf16
    micro8     8 micro-batches (of 8 rows)
    packed16 / packed8 / packed4   the trainer's layout: the rows packed (`dapo_jax.packing`, on the host,
               inside the timed update) into micro-batches of 16 / 8 / 4 packed rows of width T
`--mix longtail` swaps the responses for DAPO's shape at a smaller scale: T = 32 + 512, 3 of
the 64 responses (4.7%) at the 512 maximum, the others exponential with mean 96 (mean 22% of
the maximum), where the padded update trains mostly padding.
Variants run in turn, `--reps` rounds, and the medians are printed (so that the noise of a
shared machine falls on all of them alike), with the achieved rate of the forward + backward
FLOPs (6 * N_matmul * tokens + the attention's 12 * L * H * Q * T * tokens, plus a third of
that for a recomputed log pi_old) against the best rate
of this machine's f32 and bf16 dots at the model's own shape (6144 x 128 @ 128 x 384), measured
in the same run.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from dapo_jax import hf_model_config, logprobs, model, packing, sharding
from dapo_jax import train_step as ts

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "peers"))
import workload  # noqa: E402

CFG = hf_model_config.config_from_hf(workload.HF_CONFIG, dtype="float32")
ROWS, PROMPT = 64, 32
RESPONSE = {"uniform": 64, "longtail": 512}
VARIANTS = {  # name: (old_logp, dtype, micro-batches, packed rows per micro-batch (0: padded))
    "base": ("recompute", "float32", 1, 0),
    "detached": ("detached", "float32", 1, 0),
    "sampler": ("sampler", "float32", 1, 0),
    "micro2": ("recompute", "float32", 2, 0),
    "micro4": ("recompute", "float32", 4, 0),
    "micro8": ("recompute", "float32", 8, 0),
    "bf16": ("recompute", "bfloat16", 1, 0),
    "best": ("detached", "bfloat16", 2, 0),
    "packed16": ("recompute", "float32", 0, 16),
    "packed8": ("recompute", "float32", 0, 8),
    "packed4": ("recompute", "float32", 0, 4),
}


def response_lengths(mix: str, rng) -> np.ndarray:
    """Uniform 1-64, or the long tail: 3 rows at the maximum, the rest exponential (mean 96)."""
    n = RESPONSE[mix]
    if mix == "uniform":
        return rng.integers(1, n + 1, ROWS)
    length_B = np.clip(rng.exponential(96, ROWS).astype(int), 1, n - 1)
    length_B[rng.choice(ROWS, 3, replace=False)] = n
    return length_B


def workload(mix: str = "uniform", seed: int = 0) -> ts.Rollout:
    """64 rows: prompts of 20-32 tokens left-padded to 32, responses (`response_lengths`) right-padded."""
    rng = np.random.default_rng(seed)
    t = PROMPT + RESPONSE[mix]
    prompt_B, response_B = rng.integers(20, PROMPT + 1, ROWS), response_lengths(mix, rng)
    pos = np.arange(t)[None]
    mask = (pos >= PROMPT - prompt_B[:, None]) & (pos < PROMPT + response_B[:, None])
    tokens = np.where(mask, rng.integers(1, CFG.vocab_size, (ROWS, t)), 0).astype(np.int32)
    adv = rng.choice([-1.0, 1.0], ROWS).astype(np.float32)
    return ts.Rollout(tokens, mask, mask & (pos >= PROMPT), adv)


def dot_rate(dtype, reps: int) -> float:
    """Best FLOP/s of the model's typical dot, [6144, 128] @ [128, 384], f32 accumulation."""
    a = jnp.ones((ROWS * (PROMPT + RESPONSE["uniform"]), CFG.hidden_size), dtype)
    b = jnp.ones((CFG.hidden_size, CFG.intermediate_size), dtype)
    f = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))
    f(a, b).block_until_ready()
    best = min(_timed(lambda: f(a, b)) for _ in range(reps))
    return 2 * a.shape[0] * a.shape[1] * b.shape[1] / best


def _timed(fn) -> float:
    t = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - t


def make_update(old_logp: str, dtype: str, micro: int, micro_rows: int, mesh):
    """`update(state, rollout, sampler_logp) -> (state, metrics)`: log pi_old then one step; with
    `micro_rows` the rollout packed first (`dapo_jax.packing`)."""
    m = model.Transformer(dataclasses.replace(CFG, dtype=dtype))
    schedule = ts.learning_rate_schedule(1e-6, 0, "constant")
    opt = ts.make_optimizer(schedule, weight_decay=0.1, grad_clip=1.0)
    loss_cfg = ts.LossConfig(clip_ratio_c=10.0, temperature=1.0, old_logp=old_logp)
    rows = micro_rows or ROWS // micro  # padded rows: `micro` micro-batches of the batch
    step = ts.make_train_step(m, opt, schedule, loss_cfg, mesh, rows)
    logprobs_fn = logprobs.make_compute_logprobs(m, mesh, 1.0, rows)
    state = ts.init_train_state(m, opt, mesh, sharding.init_params(m, mesh, jax.random.key(0)))

    def update(state, rollout, sampler_logp):
        if micro_rows:
            p = packing.plan(rollout.mask_BxT, 1, micro_rows)
            rollout = ts.Rollout(
                *packing.pack_rows(p, rollout.tokens_BxT, rollout.loss_mask_BxT, rollout.adv_B)
            )
            sampler_logp = packing.pack(p, sampler_logp)
        old = (
            logprobs_fn(state.params, rollout.tokens_BxT, rollout.mask_BxT)
            if old_logp == "recompute"
            else None
        )
        state, metrics = ts.train_on_rollout(
            step, logprobs_fn, mesh, state, rollout, 1, old_logp_BxT=sampler_logp if old is None else old
        )
        return state, metrics

    return state, update


def trained_rows(rollout: ts.Rollout, micro_rows: int) -> int:
    """The rows a variant trains: the batch's, or the packed rows."""
    return packing.plan(rollout.mask_BxT, 1, micro_rows).num_rows if micro_rows else ROWS


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--mix", default="uniform", choices=tuple(RESPONSE))
    args = parser.parse_args()
    names = args.variants.split(",")
    mesh = sharding.make_mesh({"data": -1}, devices=jax.devices()[:1])
    rollout = workload(args.mix)
    sampler_logp = np.zeros(rollout.tokens_BxT.shape, np.float32)  # the "sampler"'s: a stand-in
    runs = {}
    for name in names:
        state, update = make_update(*VARIANTS[name], mesh)
        state, _ = update(state, rollout, sampler_logp)  # compile
        runs[name] = [state, update, []]
    for _ in range(args.reps):
        for name in names:
            run = runs[name]
            t = time.perf_counter()
            run[0], metrics = run[1](run[0], rollout, sampler_logp)
            jax.block_until_ready(metrics)
            run[2].append(time.perf_counter() - t)
    rates = {d: dot_rate(d, 5) for d in (jnp.float32, jnp.bfloat16)}
    n_matmul = CFG.num_params() - CFG.vocab_size * CFG.hidden_size
    t = rollout.tokens_BxT.shape[1]
    flops_of = lambda rows: rows * t * (6 * n_matmul + 12 * CFG.num_layers * CFG.num_heads * CFG.head_dim * t)
    print(
        f"backend {jax.default_backend()}, mix {args.mix}: "
        f"{ROWS} rows x T {t}, {ROWS * t} tokens, "
        f"{int(rollout.loss_mask_BxT.sum())} loss tokens, {int(rollout.mask_BxT.sum())} real"
    )
    print(
        f"fwd + bwd FLOPs {flops_of(ROWS) / 1e9:.1f} G padded; dot rate f32 {rates[jnp.float32] / 1e9:.1f} "
        f"GFLOP/s, bf16 {rates[jnp.bfloat16] / 1e9:.1f} GFLOP/s (6144x128 @ 128x384, best of 5)"
    )
    base = np.median(runs[names[0]][2])
    for name in names:
        old_logp, dtype, micro, micro_rows = VARIANTS[name]
        med = float(np.median(runs[name][2]))
        rate = rates[jnp.bfloat16 if dtype == "bfloat16" else jnp.float32]
        rows = trained_rows(rollout, micro_rows)
        floor = flops_of(rows) * (4 / 3 if old_logp == "recompute" else 1) / rate
        layout = f"packed {rows} rows, micro {micro_rows} rows" if micro_rows else f"micro {micro}"
        print(
            f"{name:9s} old_logp {old_logp:9s} {dtype:8s} {layout}: update {med:.3f} s "
            f"(x{base / med:.2f} of {names[0]}), roofline {floor:.3f} s = {floor / med:.0%}"
        )


if __name__ == "__main__":
    main()

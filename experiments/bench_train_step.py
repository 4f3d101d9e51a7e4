"""Train-step throughput: tokens/s and achieved FLOP/s against a large dense f32 matmul.

    PYTHONPATH=. python experiments/bench_train_step.py [--batch 8] [--seq 512] [--steps 3]

Model: ~20M parameters (d 384, 6 layers, 6 heads of 64, MLP 1536, vocab 8192, untied), float32.
FLOPs of one step (forward + backward), PaLM's count:
    6 * N_matmul * tokens + 12 * L * H * Q * T * tokens
N_matmul = every parameter but the input embedding (a gather, not a matmul; the LM head counts),
L layers, H query heads of size Q, T the sequence length; the attention term counts the full
T x T score matrix, which is what the model computes (masked, not skipped). The loss over the
vocabulary, softmaxes and norms are not counted. The reference is the best FLOP/s of an
n x n @ n x n f32 matmul (2 n^3 FLOPs) timed in the same run, before and after the steps.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from dapo_jax import model, sharding
from dapo_jax import train_step as ts

CFG = model.ModelConfig(
    vocab_size=8192,
    hidden_size=384,
    intermediate_size=1536,
    num_layers=6,
    num_heads=6,
    num_kv_heads=6,
    head_dim=64,
    dtype="float32",
)


def matmul_flops_per_s(n: int, reps: int) -> float:
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.float32)
    mm = jax.jit(jnp.matmul)
    mm(a, b).block_until_ready()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        mm(a, b).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best


def synthetic_batch(batch: int, seq: int) -> ts.Batch:
    """Prompts of seq / 4 tokens, responses filling the rest: every position is computed."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, CFG.vocab_size, (batch, seq)).astype(np.int32)
    mask = np.ones((batch, seq), bool)
    loss_mask = mask & (np.arange(seq) >= seq // 4)
    old_logp = np.full((batch, seq), -np.log(CFG.vocab_size), np.float32)
    return ts.Batch(tokens, mask, loss_mask, rng.choice([-1.0, 1.0], batch), old_logp, None)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--matmul", type=int, default=2048)
    args = parser.parse_args()

    m = model.Transformer(CFG)
    mesh = sharding.make_mesh({"data": -1}, devices=jax.devices()[:1])
    schedule = ts.learning_rate_schedule(1e-6, 10, "constant")
    opt = ts.make_optimizer(schedule, weight_decay=0.1, grad_clip=1.0)
    loss_cfg = ts.LossConfig(clip_ratio_c=10.0, temperature=1.0)  # DAPO's loss
    step = ts.make_train_step(m, opt, schedule, loss_cfg, mesh, args.batch)  # one micro-batch
    state = ts.init_train_state(m, opt, mesh, sharding.init_params(m, mesh, jax.random.key(0)))
    batch = synthetic_batch(args.batch, args.seq)

    n_params = CFG.num_params()
    n_matmul = n_params - CFG.vocab_size * CFG.hidden_size
    tokens = args.batch * args.seq
    attn = 12 * CFG.num_layers * CFG.num_heads * CFG.head_dim * args.seq * tokens
    flops = 6 * n_matmul * tokens + attn

    peak_before = matmul_flops_per_s(args.matmul, 3)
    t = time.perf_counter()
    state, metrics = step(state, batch)
    jax.block_until_ready(metrics)
    compile_s = time.perf_counter() - t
    times = []
    for _ in range(args.steps):
        t = time.perf_counter()
        state, metrics = step(state, batch)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - t)
    peak_after = matmul_flops_per_s(args.matmul, 3)
    peak = max(peak_before, peak_after)
    best = min(times)

    print(f"backend {jax.default_backend()}, {jax.devices()[0].device_kind}")
    print(
        f"model {n_params / 1e6:.1f}M params ({n_matmul / 1e6:.1f}M in matmuls), "
        f"batch {args.batch} x seq {args.seq} = {tokens} tokens/step, float32"
    )
    print(f"FLOPs/step = 6*{n_matmul}*{tokens} + 12*L*H*Q*T*tokens ({attn:.3g}) = {flops:.3g}")
    print(
        f"first step (compile + run) {compile_s:.1f} s; step times {', '.join(f'{x:.2f}' for x in times)} s"
    )
    print(f"train step: {tokens / best:,.0f} tokens/s, {flops / best / 1e9:.1f} GFLOP/s")
    print(
        f"dense {args.matmul}^3 f32 matmul: {peak_before / 1e9:.1f} GFLOP/s before, "
        f"{peak_after / 1e9:.1f} after"
    )
    print(
        f"achieved / matmul: {flops / best / peak:.1%} "
        f"(counting all {n_params / 1e6:.1f}M params as 6N: "
        f"{(6 * n_params * tokens + attn) / best / peak:.1%}); "
        f"loss {float(metrics['loss']):.4f}, skipped {float(metrics['skipped']):.0f}"
    )


if __name__ == "__main__":
    main()

"""Rollout throughput at a long-tailed length distribution: the fixed-batch sampler against the
engine (`SamplingConfig.paged`: continuous batching in `decode_slots` slots over a paged KV
cache), in one invocation, on one tiny random Qwen2. (The unpaged slot loop and the loop per
device it was also compared with retired at the engine's landing; their figures stay in
experiments/README.md.)

The model: the peer benchmark's Qwen2 (experiments/peers/workload.py: hidden 128, 5 layers,
vocabulary 128, q/k/v bias) with random weights, its LM head scaled by `--head_scale` so that the
next-token distribution depends on the state, and `--end_ids` ids ending a row. The per-step end
probability then varies from row to row, which gives a tail heavier than a geometric one: with
the defaults the responses averaged a quarter of the limit and ~3% reached it in a trial before
the model had its q/k/v bias (the script prints what it measured). Useful tokens are the rows'
lengths (non-pad tokens); each sampler is timed after its compilation, the runs alternating, the
median of `--repeats`. Both samplers return the same rows (checked here).

    PYTHONPATH=. python experiments/bench_rollout.py --engine 16 64     # long tail, limit 256
    PYTHONPATH=. python experiments/bench_rollout.py --new 64 --end_ids 0  # uniform: every row 64
    PYTHONPATH=. python experiments/bench_rollout.py --devices 1 2      # also on 2 CPU devices
    PYTHONPATH=. python experiments/bench_rollout.py --engine 16 64 --new 2048 --vocab 2048

`--vocab` widens the vocabulary (and so lowers the per-step end probability, for long limits).
For the engine it also prints its decode steps and the mean step's time against this machine's
memory-bandwidth roofline: the bytes a step must read (the weights, and the keys and values the
running rows hold, from the measured lengths) over the bandwidth of a large array sum, measured in
the same run.
"""

import argparse
import dataclasses
import os
import sys
import time

import jax
import numpy as np

from dapo_jax import decoding, engine, hf_model_config, model, sampler, sharding

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "peers"))
import workload  # noqa: E402


def random_model(config, head_scale: float, devices: int, seed: int = 0):
    m = model.Transformer(config)
    mesh = sharding.make_mesh({"data": -1}, devices=jax.devices()[:devices])
    params = sharding.init_params(m, mesh, jax.random.key(seed))
    params["lm_head"]["kernel"] = params["lm_head"]["kernel"] * head_scale
    return m, mesh, params


def prompts(p: int, width: int, vocab: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    lengths_P = rng.integers(width // 2, width + 1, size=p)
    mask_PxQ = np.arange(width)[None] >= width - lengths_P[:, None]
    tokens_PxQ = rng.integers(1 + vocab // 8, vocab, size=(p, width))
    return np.where(mask_PxQ, tokens_PxQ, 0).astype(np.int32), mask_PxQ


def timed(s: sampler.Sampler, params, tokens, mask, group: int):
    """A function that runs `s` once (compiled here) and returns (seconds, outputs)."""
    jax.block_until_ready(s.generate(params, tokens, mask, group, jax.random.key(0)))

    def run(seed):
        start = time.perf_counter()
        out = jax.block_until_ready(s.generate(params, tokens, mask, group, jax.random.key(seed)))
        return time.perf_counter() - start, jax.device_get(out)

    return run


def bandwidth_bytes_per_s(mib: int = 512) -> float:
    """This machine's memory bandwidth as XLA:CPU reads it: a sum over a `mib` MiB f32 array
    (far past the caches), the best of 5."""
    x = jax.numpy.ones((mib << 18,), jax.numpy.float32)
    total = jax.jit(jax.numpy.sum)
    jax.block_until_ready(total(x))
    best = min(_seconds(lambda: jax.block_until_ready(total(x))) for _ in range(5))
    return x.nbytes / best


def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def engine_roofline(name, m, params, cfg, tokens, mask, group, lengths_B, seconds, bandwidth):
    """The engine's decode steps (run once more for its stats) and its mean step against the
    bytes a step must read: weights once, plus the keys and values the running rows hold."""
    uids = np.arange(tokens.shape[0], dtype=np.int32)
    u_BxN = decoding.row_uniforms(jax.random.key(1), uids, group, cfg.max_new_tokens)
    run = jax.jit(lambda p, t, k, u: engine.paged_rollout(m, cfg, group, p, t, k, u)[1])
    steps = int(run(params, tokens, mask, u_BxN)["steps"])
    c = m.config
    weights = sum(x.nbytes for x in jax.tree.leaves(params))
    prompt_B = np.repeat(mask.sum(-1), group)
    held = np.sum(lengths_B * (prompt_B - 1) + lengths_B * (lengths_B + 1) / 2)  # keys read, all steps
    kv = held * 2 * c.num_kv_heads * c.head_dim * np.dtype(c.dtype).itemsize * c.num_layers
    step_bytes = weights + kv / steps
    step_s = seconds / steps
    print(
        f"{name}: {steps} decode steps, {step_s * 1e3:.3f} ms a step; it reads {step_bytes / 2**20:.2f} MiB "
        f"(weights {weights / 2**20:.2f}, KV {kv / steps / 2**20:.2f}): "
        f"{step_bytes / bandwidth * 1e3:.3f} ms "
        f"at {bandwidth / 1e9:.1f} GB/s, the step {step_s / (step_bytes / bandwidth):.1f}x that roofline"
    )


def _args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--new", type=int, default=256, help="N, the response length limit")
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--engine", type=int, nargs="*", default=[16], help="the engine's S (slots)")
    ap.add_argument("--page", type=int, default=16, help="the engine's page size Z")
    ap.add_argument("--end_ids", type=int, default=2, help="ids 1..k end a row (0: none)")
    ap.add_argument("--head_scale", type=float, default=8.0)
    ap.add_argument("--vocab", type=int, default=0, help="vocabulary size (0: the workload's 128)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument(
        "--devices",
        type=int,
        nargs="+",
        default=[1],
        help="meshes to run on: the data axis over this many XLA CPU devices (the host split as the "
        "make demo's JAX_NUM_CPU_DEVICES=2 does); the first mesh's fixed batch is the baseline",
    )
    return ap.parse_args()


def samplers(args, config, cfg, tokens, mask):
    """name -> a timed run of each sampler, on each mesh; and name -> (model, params, config) of
    the engine's runs."""
    runs, engines = {}, {}
    for d in args.devices:
        m, mesh, params = random_model(config, args.head_scale, d)
        on = "" if args.devices == [1] else f" on {d} device{'s' if d > 1 else ''}"
        runs[f"fixed batch{on}"] = timed(sampler.Sampler(m, cfg, mesh), params, tokens, mask, args.group)
        for s in args.engine:
            paged = dataclasses.replace(cfg, decode_slots=s, paged=True, page_size=args.page)
            runs[f"engine, {s} slots{on}"] = timed(
                sampler.Sampler(m, paged, mesh), params, tokens, mask, args.group
            )
            if d == 1:  # the roofline on one device
                engines[f"engine, {s} slots{on}"] = (m, params, paged)
    return runs, engines


def main():
    args = _args()
    jax.config.update("jax_num_cpu_devices", max(args.devices))
    vocab = args.vocab or workload.HF_CONFIG["vocab_size"]
    config = hf_model_config.config_from_hf({**workload.HF_CONFIG, "vocab_size": vocab}, dtype="float32")
    tokens, mask = prompts(args.prompts, args.prompt, vocab)
    cfg = decoding.SamplingConfig(
        max_new_tokens=args.new,
        eos_ids=tuple(range(1, args.end_ids + 1)),
        pad_id=0,
        prompt_buckets=(args.prompt,),
    )
    runs, engines = samplers(args, config, cfg, tokens, mask)
    first = next(iter(runs))
    seconds, lengths, differ = {name: [] for name in runs}, [], dict.fromkeys(runs, 0)
    for i in range(args.repeats):
        outs = {}
        for name, run in runs.items():
            time.sleep(0.5)
            sec, outs[name] = run(i + 1)
            seconds[name].append(sec)
        for name, out in outs.items():  # the same rows, whatever the loop (to float rounding)
            differ[name] += int(np.any(out.tokens_BxN != outs[first].tokens_BxN, axis=1).sum())
        lengths.append(outs[first].length_B)
    print(
        f"model: random Qwen2 {config.num_params() / 1e6:.2f}M params, vocabulary {vocab}, head "
        f"x{args.head_scale}; {args.prompts} prompts x G={args.group}, prompts of {args.prompt}, limit "
        f"N={args.new}; jax {jax.__version__} on {jax.devices()[0].platform}"
    )
    report(args, runs, seconds, np.concatenate(lengths))
    print(f"rows whose tokens differ from the {first}'s: {differ}")
    bandwidth = bandwidth_bytes_per_s()
    for name, (m, params, paged) in engines.items():
        med = float(np.median(seconds[name]))
        engine_roofline(name, m, params, paged, tokens, mask, args.group, lengths[0], med, bandwidth)


def report(args, runs, seconds, lengths):
    print(
        f"lengths over {len(lengths)} rows: mean {lengths.mean():.1f} = {lengths.mean() / args.new:.0%} "
        f"of N, median {np.median(lengths):.0f}, p90 {np.percentile(lengths, 90):.0f}, "
        f"truncated {np.mean(lengths == args.new):.1%}"
    )
    first = next(iter(runs))
    useful = lengths.sum() / args.repeats  # per run
    base = np.median(seconds[first])
    for name, sec in seconds.items():
        med = float(np.median(sec))
        print(
            f"{name + ':':28s}{useful / med:9.0f} useful tokens/s  ({med:.3f} s a batch, median of "
            f"{args.repeats}; {base / med:.2f}x the {first})"
        )


if __name__ == "__main__":
    main()

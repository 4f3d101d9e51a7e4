"""Rollout throughput at a long-tailed length distribution: the fixed-batch sampler against
continuous batching (`SamplingConfig.decode_slots`), in one invocation, on one tiny random Qwen2.

The model: the peer benchmark's Qwen2 (experiments/peers/workload.py: hidden 128, 5 layers,
vocabulary 128, q/k/v bias) with random weights, its LM head scaled by `--head_scale` so that the
next-token distribution depends on the state, and `--end_ids` ids ending a row. The per-step end
probability then varies from row to row, which gives a tail heavier than a geometric one: with
the defaults the responses averaged a quarter of the limit and ~3% reached it in a trial before
the model had its q/k/v bias (the script prints what it measured). Useful tokens are the rows'
lengths (non-pad tokens); each sampler is timed after its compilation, the runs alternating, the
median of `--repeats`. Both samplers return the same rows (checked here).

    PYTHONPATH=. python experiments/bench_rollout.py                    # long tail, limit 256
    PYTHONPATH=. python experiments/bench_rollout.py --new 64 --end_ids 0  # uniform: every row 64
    PYTHONPATH=. python experiments/bench_rollout.py --devices 1 2      # also on 2 CPU devices
"""

import argparse
import dataclasses
import os
import sys
import time

import jax
import numpy as np

from dapo_jax import hf_io, model, sampler, sharding

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "peers"))
import workload  # noqa: E402

CONFIG = hf_io.config_from_hf(workload.HF_CONFIG, dtype="float32")


def random_model(head_scale: float, devices: int, seed: int = 0):
    m = model.Transformer(CONFIG)
    mesh = sharding.make_mesh({"data": -1}, devices=jax.devices()[:devices])
    params = sharding.init_params(m, mesh, jax.random.key(seed))
    params["lm_head"]["kernel"] = params["lm_head"]["kernel"] * head_scale
    return m, mesh, params


def prompts(p: int, width: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    lengths_P = rng.integers(width // 2, width + 1, size=p)
    mask_PxL = np.arange(width)[None] >= width - lengths_P[:, None]
    tokens_PxL = rng.integers(1 + CONFIG.vocab_size // 8, CONFIG.vocab_size, size=(p, width))
    return np.where(mask_PxL, tokens_PxL, 0).astype(np.int32), mask_PxL


def timed(s: sampler.Sampler, params, tokens, mask, group: int):
    """A function that runs `s` once (compiled here) and returns (seconds, outputs)."""
    jax.block_until_ready(s.generate(params, tokens, mask, group, jax.random.key(0)))

    def run(seed):
        start = time.perf_counter()
        out = jax.block_until_ready(s.generate(params, tokens, mask, group, jax.random.key(seed)))
        return time.perf_counter() - start, jax.device_get(out)

    return run


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--new", type=int, default=256, help="N, the response length limit")
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--slots", type=int, nargs="+", default=[16])
    ap.add_argument("--end_ids", type=int, default=2, help="ids 1..k end a row (0: none)")
    ap.add_argument("--head_scale", type=float, default=8.0)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument(
        "--devices",
        type=int,
        nargs="+",
        default=[1],
        help="meshes to run on: the data axis over this many XLA CPU devices (the host split as the "
        "tiny config's cpu_devices does); the first mesh's fixed batch is the baseline",
    )
    args = ap.parse_args()
    sharding.use_cpu_devices(max(args.devices))
    tokens, mask = prompts(args.prompts, args.prompt)
    cfg = sampler.SamplingConfig(
        max_new_tokens=args.new,
        eos_ids=tuple(range(1, args.end_ids + 1)),
        pad_id=0,
        prompt_buckets=(args.prompt,),
    )
    runs = {}
    for d in args.devices:
        m, mesh, params = random_model(args.head_scale, d)
        on = "" if args.devices == [1] else f" on {d} device{'s' if d > 1 else ''}"
        runs[f"fixed batch{on}"] = timed(sampler.Sampler(m, cfg, mesh), params, tokens, mask, args.group)
        for s in args.slots:
            slot_cfg = dataclasses.replace(cfg, decode_slots=s)
            runs[f"{s} slots{on}"] = timed(
                sampler.Sampler(m, slot_cfg, mesh), params, tokens, mask, args.group
            )
    first = next(iter(runs))
    seconds, lengths = {name: [] for name in runs}, []
    for i in range(args.repeats):
        outs = {}
        for name, run in runs.items():
            time.sleep(0.5)
            sec, outs[name] = run(i + 1)
            seconds[name].append(sec)
        for name, out in outs.items():  # the same rows, whatever the loop
            np.testing.assert_array_equal(out["tokens"], outs[first]["tokens"], err_msg=name)
        lengths.append(outs[first]["length"])
    lengths = np.concatenate(lengths)
    print(
        f"model: random Qwen2 {CONFIG.num_params() / 1e6:.2f}M params, head x{args.head_scale}; "
        f"{args.prompts} prompts x G={args.group}, prompts of {args.prompt}, limit N={args.new}; "
        f"jax {jax.__version__} on {jax.devices()[0].platform}"
    )
    print(
        f"lengths over {len(lengths)} rows: mean {lengths.mean():.1f} = {lengths.mean() / args.new:.0%} "
        f"of N, median {np.median(lengths):.0f}, p90 {np.percentile(lengths, 90):.0f}, "
        f"truncated {np.mean(lengths == args.new):.1%}"
    )
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

"""Decode throughput of `sampler.Sampler` against transformers `generate` on one tiny Qwen2 (CPU, f32).

Both sample (T = 1, no truncation, no end id, so every row makes all N tokens) from the same weights,
the same left-padded prompts, timed in the same run after a warm-up (ours: after compilation, with
block_until_ready), alternating, the median of the repeats. The time covers prefill and decode.
`--group G` samples G completions of each of B / G prompts, as DAPO does (transformers:
`num_return_sequences`); ours then runs each prompt's prefill once.
Then an estimate of what bounds our step: FLOPs per token against a measured matmul peak, bytes
read per step (weights + the KV cache slots read) against a measured memory bandwidth, and the
per-step floor of a batch of 8 rows.

    PYTHONPATH=. python experiments/bench_sampler.py --batch 128 --new 128 --prompt 32 [--group 16]
"""

import argparse
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers

from dapo_jax import decoding, fixed_batch, hf_io, hf_model_config, model, sampler, sharding

QWEN2_TINY = dict(
    vocab_size=4096,
    hidden_size=256,
    intermediate_size=704,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    tie_word_embeddings=False,
)


def prompts(batch, width, vocab, seed=0):
    rng = np.random.default_rng(seed)
    lengths_P = rng.integers(width // 2, width + 1, size=batch)
    mask_PxQ = np.arange(width)[None] >= width - lengths_P[:, None]
    return np.where(mask_PxQ, rng.integers(1, vocab, size=(batch, width)), 0).astype(np.int32), mask_PxQ


def ours(m, params, mesh, tokens, mask, new, group=1):
    """A function that runs our sampler once (compiled here) and returns its seconds."""
    cfg = decoding.SamplingConfig(max_new_tokens=new, eos_ids=(), pad_id=0, prompt_buckets=(tokens.shape[1],))
    s = sampler.Sampler(m, cfg, mesh)
    out = jax.block_until_ready(s.generate(params, tokens, mask, group, jax.random.key(0)))
    assert int(out.length_B.min()) == new

    def run(seed):
        start = time.perf_counter()
        jax.block_until_ready(s.generate(params, tokens, mask, group, jax.random.key(seed)))
        assert s.num_traces == 1
        return time.perf_counter() - start

    return run


def theirs(model_dir, tokens, mask, new, group=1):
    """A function that runs transformers `generate` once (warmed up here) and returns its seconds."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids, attn = torch.tensor(tokens, dtype=torch.long), torch.tensor(mask, dtype=torch.long)
    kw = dict(
        do_sample=True,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        eos_token_id=None,
        pad_token_id=0,
        num_return_sequences=group,
    )
    with torch.inference_mode():
        hf.generate(input_ids=ids, attention_mask=attn, max_new_tokens=8, **kw)  # warm-up

    def run(seed):
        torch.manual_seed(seed)
        with torch.inference_mode():
            start = time.perf_counter()
            out = hf.generate(input_ids=ids, attention_mask=attn, max_new_tokens=new, **kw)
            seconds = time.perf_counter() - start
        assert out.shape == (tokens.shape[0] * group, tokens.shape[1] + new)
        return seconds

    return run


def interleaved(runs: dict, repeats: int) -> dict:
    """Median seconds of each run, the runs alternating so that a slow spell hits all of them, each
    after a pause (a thread pool that still spins after its run would slow the next one)."""
    seconds = {name: [] for name in runs}
    for i in range(repeats):
        for name, run in runs.items():
            time.sleep(1.0)
            seconds[name].append(run(i + 1))
    return {name: float(np.median(v)) for name, v in seconds.items()}


def matmul_flops_per_s(n=1024, repeats=20):
    a = jnp.ones((n, n), jnp.float32)
    f = jax.jit(lambda x: x @ x)
    jax.block_until_ready(f(a))
    start = time.perf_counter()
    for _ in range(repeats):
        jax.block_until_ready(f(a))
    return 2 * n**3 * repeats / (time.perf_counter() - start)


def bytes_per_s(mb=512, repeats=10):
    x = jnp.ones((mb * 2**20 // 4,), jnp.float32)
    f = jax.jit(lambda x: jnp.sum(x))
    jax.block_until_ready(f(x))
    start = time.perf_counter()
    for _ in range(repeats):
        jax.block_until_ready(f(x))
    return x.nbytes * repeats / (time.perf_counter() - start)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--group", type=int, default=1, help="completions per prompt (B / G prompts)")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    b, n, l, g = args.batch, args.new, args.prompt, args.group
    if b % g:
        ap.error(f"--batch {b} is not a multiple of --group {g}")

    torch.manual_seed(0)
    model_dir = tempfile.mkdtemp()
    transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**QWEN2_TINY)).save_pretrained(model_dir)
    cfg = hf_model_config.config_from_hf(hf_model_config.read_hf_config(model_dir), dtype="float32")
    m = model.Transformer(cfg)
    mesh = sharding.make_mesh({"data": -1}, devices=jax.devices()[:1])
    params = hf_io.load_params(model_dir, m, mesh)
    tokens, mask = prompts(b // g, l, cfg.vocab_size)
    print(
        f"model: Qwen2 {cfg.num_params() / 1e6:.2f}M params ({QWEN2_TINY}); batch {b} x {n} new "
        f"tokens ({b // g} prompts x {g}), prompts left padded to {l}; "
        f"jax {jax.__version__} on {jax.devices()[0].platform}, "
        f"torch {torch.__version__} with {torch.get_num_threads()} threads"
    )

    times = interleaved(
        {
            "ours": ours(m, params, mesh, tokens, mask, n, g),
            "transformers": theirs(model_dir, tokens, mask, n, g),
        },
        args.repeats,
    )
    for name, sec in times.items():
        print(
            f"{name + ':':14s}{b * n / sec:9.0f} tokens/s  ({sec:.2f} s per batch, "
            f"{1e3 * sec / n:.1f} ms/step; median of {args.repeats})"
        )
    print(f"ratio ours / transformers: {times['transformers'] / times['ours']:.2f}x")

    # What bounds a decode step of B rows over a mean of S cache slots.
    d, kv = cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim
    phases = fixed_batch.decode_phases(decoding.SamplingConfig(n, (), 0, (l,)), l)
    s = np.mean([next(slots for end, slots in phases if t < end) for t in range(n)])  # slots read
    dense = cfg.num_params() - cfg.vocab_size * d  # the embedding table is gathered, not multiplied
    flops_token = 2 * dense + 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * s  # QK^T, PV
    weight_bytes = 4 * dense
    kv_bytes = int(4 * 2 * cfg.num_layers * b * s * kv)
    peak_flops, bandwidth = matmul_flops_per_s(), bytes_per_s()
    step = times["ours"] / n
    achieved = flops_token * b / step
    print(
        f"compute: {flops_token / 1e6:.1f} MFLOP/token -> {achieved / 1e9:.1f} GFLOP/s achieved vs "
        f"{peak_flops / 1e9:.1f} GFLOP/s measured f32 matmul peak ({achieved / peak_flops:.0%})"
    )
    mem_step = (weight_bytes + kv_bytes) / bandwidth
    print(
        f"memory: {weight_bytes / 2**20:.1f} MiB weights + {kv_bytes / 2**20:.1f} MiB KV cache "
        f"(a mean {s:.0f} of {phases[-1][1]} slots read) "
        f"per step -> {1e3 * mem_step:.2f} ms at {bandwidth / 2**30:.1f} GiB/s measured "
        f"({mem_step / step:.0%} of the {1e3 * step:.1f} ms step)"
    )
    rows = min(8, len(tokens))
    small = (
        interleaved({"few": ours(m, params, mesh, tokens[:rows], mask[:rows], n)}, args.repeats)["few"] / n
    )
    print(f"per-step floor (batch {rows}): {1e3 * small:.2f} ms = {small / step:.0%} of the batch-{b} step")


if __name__ == "__main__":
    main()

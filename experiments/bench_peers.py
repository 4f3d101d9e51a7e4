"""The whole DAPO step of dapo_jax against TRL's and Tunix's on one workload, in one run.

    nice -n 10 .venv/bin/python experiments/bench_peers.py --max_new_tokens 64
    nice -n 10 .venv/bin/python experiments/bench_peers.py --max_new_tokens 256

(peer virtualenvs: `bash experiments/setup_peers.sh`, default /work/peers/{trl,tunix}; choose
others with --trl_python / --tunix_python, and our interpreter with --ours_python.)

The reference workload, the same for all three (experiments/peers/workload.py):
- a random 1.02M-parameter Qwen2 (hidden 128, 5 layers, 4 query and 2 KV heads of 32,
  intermediate 384, untied head, vocabulary 128 of which the character tokenizer of
  make_tiny_model.py uses 99),
  written at start to a temporary Hugging Face folder that every implementation loads; the
  tokenizer is loaded as `PreTrainedTokenizerFast` everywhere (AutoTokenizer would map the qwen2
  folder to Qwen2Tokenizer and drop its spaces) and each runner checks that a string with
  spaces round-trips;
- 8 prompts of 18 characters (no prompt padding anywhere) x G = 8 responses, at most
  --max_new_tokens new tokens, temperature 1, top_p 1, no top_k; reward = the share of digits
  in the response (`workload.char_reward`); no overlong penalty, no dynamic sampling, no
  evaluation, no checkpoints inside the timed steps;
- DAPO loss: eps_low 0.2, eps_high 0.28, beta 0 (no reference model), token-mean over the
  batch, advantages (R - mean) / (std + eps) per group; one AdamW update per step on the
  whole batch of 64 (lr --lr, weight decay 0, betas 0.9/0.999, eps 1e-8, global-norm clip 1),
  constant learning rate; f32 parameters and compute in all three;
- --warmup steps (compilation) then --steps timed ones; figures are medians over the timed
  steps: s/step, generation s (sampling + reward + whatever the implementation does before its
  update), update s (the rest: log-probs, loss, backward, optimizer), generated tokens/s, trained
  (response) tokens/s, and the peak RSS of the implementation's own process.

How each implementation is run (each in its own process and virtualenv, threads = the cores):
- ours (peers/run_ours.py): `dapo_jax.train.train` on `configs/dapo.py:tiny` with the overrides
  above, log pi_old detached (one update per rollout batch, as the peers do); times from the
  trainer's timing/rollout_s, timing/train_s, timing/step_s metrics.
  Its update accumulates the gradient of the 64 rows over 4 micro-batches of 16 (the tiny
  config's `train.micro_batch_size`: faster on this CPU, and less memory) before the one AdamW
  step; TRL's batch of 64 goes through in one pass (per_device_train_batch_size 64,
  gradient_accumulation_steps 1).
- TRL (peers/run_trl.py): `GRPOTrainer` with `GRPOConfig(loss_type="dapo", epsilon=0.2,
  epsilon_high=0.28, beta=0.0, num_generations=8, per_device_train_batch_size=64,
  gradient_accumulation_steps=1, num_iterations=1, max_completion_length=N, temperature=1,
  top_p=1, top_k=0, scale_rewards="group", mask_truncated_completions=False)`, torch on CPU,
  f32; no logging backends, no saving. Generation s = its `_generate_and_score_completions`
  (sampling with transformers' generate, rewards, advantages; with one update per generation
  it computes no old log-probs), update s = the rest of the optimizer step.
- Tunix (peers/run_tunix.py): `DAPOLearner` with `DAPOConfig` (num_generations 8,
  num_iterations 1, epsilon 0.2, epsilon_high 0.28, beta = 0 set after construction, the
  overlong buffer off), tunix's Qwen2 loaded from the safetensors, vanilla rollout engine,
  a 1-device mesh with AxisType.Auto, numpy batches, an int rollout seed; generation s = its
  rollout + rewards (`_generate_and_compute_advantage`), update s = the rest.

Then a roofline of our step: the measured dense f32 matmul rate (jax, 1024^3, in our process)
against the least FLOPs our step needs (`step_flops`: a token's forward is 2 x the matmul
parameters plus the attention scores; generation = one prefill a prompt + a forward a generated
token; update = 3 x the forward over every row's tokens), as the fraction of that rate that
generation and the update achieve.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(HERE, "peers"))
import workload  # noqa: E402

RUNNERS = {"ours": "run_ours.py", "trl": "run_trl.py", "tunix": "run_tunix.py"}


def build_model(out: str, seed: int) -> dict:
    """A random Qwen2 and the character tokenizer in the Hugging Face folder `out`; its config."""
    sys.path.insert(0, HERE)
    import jax  # pylint: disable=import-outside-toplevel
    import make_tiny_model  # pylint: disable=import-outside-toplevel

    from dapo_jax import hf_model_config, hf_save, model, sharding  # pylint: disable=import-outside-toplevel

    hf_config = workload.HF_CONFIG
    m = model.Transformer(hf_model_config.config_from_hf(hf_config, dtype="float32"))
    mesh = sharding.make_mesh({"data": -1}, devices=jax.devices()[:1])
    hf_save.save_params(sharding.init_params(m, mesh, jax.random.key(seed)), hf_config, out)
    make_tiny_model.build_tokenizer().save_pretrained(out)
    with open(os.path.join(out, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": 2, "pad_token_id": 0, "bos_token_id": 1}, f)
    return hf_config


def run_peer(name: str, python: str, spec_path: str, log_dir: str, timeout: float) -> dict | None:
    """Runs one implementation's runner; its JSON result, or None (and the log's tail) on failure."""
    log_path = os.path.join(log_dir, f"{name}.log")
    env = {**os.environ, "PYTHONPATH": REPO, "TOKENIZERS_PARALLELISM": "false"}
    start = time.time()
    with open(log_path, "w") as log:
        try:
            proc = subprocess.run(
                [python, os.path.join(HERE, "peers", RUNNERS[name]), spec_path],
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                env=env,
                cwd=REPO,
                timeout=timeout,
                check=False,
            )
            out, rc = proc.stdout, proc.returncode
        except subprocess.TimeoutExpired:
            out, rc = "", "timeout"
    lines = [line for line in out.splitlines() if line.startswith("BENCH_JSON ")]
    print(f"{name}: {time.time() - start:.0f} s wall (log: {log_path})", flush=True)
    if rc != 0 or not lines:
        with open(log_path) as f:
            tail = f.read()[-3000:]
        print(f"{name} FAILED (exit {rc}):\n{out[-2000:]}\n{tail}", flush=True)
        return None
    return json.loads(lines[-1][len("BENCH_JSON ") :])


def rates(result: dict) -> dict:
    """Generated and trained tokens/s of a result: medians over its timed steps."""
    steps = result["steps"]
    return {
        "gen_tok_s": statistics.median(s["tokens"] / s["gen_s"] for s in steps),
        "train_tok_s": statistics.median(s["tokens"] / s["update_s"] for s in steps),
    }


def table(results: dict) -> str:
    """The comparison, one row an implementation; x ours = its time (or memory) over ours."""
    ours = results.get("ours")
    head = (
        f"{'impl':6s} {'s/step':>7s} {'gen s':>6s} {'upd s':>6s} {'gen tok/s':>10s} "
        f"{'trn tok/s':>10s} {'tok/step':>8s} {'RSS MiB':>8s}"
    )
    if ours:
        head += f" {'step x ours':>11s} {'gen x ours':>10s} {'upd x ours':>10s} {'RSS x ours':>10s}"
    lines = [head]
    for name, r in results.items():
        rt = rates(r)
        line = (
            f"{name:6s} {r['step_s']:7.3f} {r['gen_s']:6.3f} {r['update_s']:6.3f} "
            f"{rt['gen_tok_s']:10.0f} {rt['train_tok_s']:10.0f} {r['tokens']:8.0f} {r['peak_rss_mib']:8.0f}"
        )
        if ours:
            line += (
                f" {r['step_s'] / ours['step_s']:11.2f} {r['gen_s'] / ours['gen_s']:10.2f}"
                f" {r['update_s'] / ours['update_s']:10.2f} {r['peak_rss_mib'] / ours['peak_rss_mib']:10.2f}"
            )
        lines.append(line)
    if ours:
        lines.append("x ours: the figure over ours (times and RSS: above 1 = ours faster or smaller)")
    return "\n".join(lines)


def token_flops(hf: dict, matmul_params: int, context: float) -> float:
    """FLOPs of one token's forward: 2 x the matmul parameters, plus QK^T and AV over `context`
    earlier positions (4 x heads x head_dim x context a layer)."""
    heads = hf["num_hidden_layers"] * hf["num_attention_heads"] * hf["head_dim"]
    return 2 * matmul_params + 4 * heads * context


def step_flops(hf: dict, prompts: int, group: int, prompt_len: int, response: float) -> tuple[float, float]:
    """(generation, update) FLOPs of a step, the least work each needs: generation = one
    prefill a prompt (its G rows share it) + one forward a generated token; update = forward +
    backward (3 x forward) over every row's prompt and response tokens, causal (the context
    averages half the row)."""
    n = num_params(hf) - hf["vocab_size"] * hf["hidden_size"]  # the input embedding is a lookup
    rows, length = prompts * group, prompt_len + response
    prefill = prompts * prompt_len * token_flops(hf, n, prompt_len / 2)
    decode = rows * response * token_flops(hf, n, prompt_len + response / 2)
    return prefill + decode, 3 * rows * length * token_flops(hf, n, length / 2)


def roofline(hf: dict, ours: dict, prompts: int, group: int, prompt_len: int) -> str:
    """Our generation and update against the matmul rate measured in our process."""
    total, embed = num_params(hf), hf["vocab_size"] * hf["hidden_size"]
    peak = ours["settings"]["matmul_gflops"] * 1e9
    response = ours["tokens"] / (prompts * group)
    gen, upd = step_flops(hf, prompts, group, prompt_len, response)
    return "\n".join(
        [
            f"roofline: dense f32 matmul {peak / 1e9:.1f} GFLOP/s (jax, 1024^3, this run); "
            f"{total:,} parameters, {total - embed:,} in matmuls; "
            f"{prompts} x {group} rows x ({prompt_len} prompt + {response:.1f} response tokens)",
            _achieved("generation", gen, ours["gen_s"], peak),
            _achieved("update:    ", upd, ours["update_s"], peak),
            f"  floor at the matmul rate: generation {gen / peak:.3f} s, update {upd / peak:.3f} s, "
            f"step {(gen + upd) / peak:.3f} s (ours {ours['step_s']:.3f} s)",
        ]
    )


def _achieved(what: str, flops: float, seconds: float, peak: float) -> str:
    rate = flops / seconds
    return (
        f"  {what} {flops / 1e9:.3f} GFLOP in {seconds:.3f} s = {rate / 1e9:.2f} GFLOP/s, "
        f"{100 * rate / peak:.1f}% of the matmul rate"
    )


def num_params(hf: dict) -> int:
    """Parameters of an untied Qwen2 (q/k/v biases) of Hugging Face config `hf`."""
    d, f, v = hf["hidden_size"], hf["intermediate_size"], hf["vocab_size"]
    q, kv = hf["num_attention_heads"] * hf["head_dim"], hf["num_key_value_heads"] * hf["head_dim"]
    layer = d * q + q + 2 * (d * kv + kv) + q * d + 3 * d * f + 2 * d
    return hf["num_hidden_layers"] * layer + 2 * v * d + d


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--max_new_tokens", type=int, default=64)
    p.add_argument("--steps", type=int, default=5, help="timed steps (medians over these)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first (compilation)")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group_size", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--impls", default="ours,trl,tunix", help="comma-separated subset of ours,trl,tunix")
    p.add_argument("--ours_python", default=sys.executable)
    p.add_argument(
        "--ours_set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a dotted override of our config (repeatable), e.g. loss.old_logp=detached; VALUE is JSON "
        "or a bare string",
    )
    p.add_argument("--trl_python", default="/work/peers/trl/bin/python")
    p.add_argument("--tunix_python", default="/work/peers/tunix/bin/python")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per implementation")
    p.add_argument("--json_out", default="", help="also write every result to this JSON file")
    p.add_argument("--json_in", default="", help="print the report of a --json_out file; run nothing")
    return p.parse_args()


def parse_override(text: str) -> tuple[str, object]:
    """`("section.key", value)` of a `--ours_set KEY=VALUE`: VALUE read as JSON, else as a string."""
    key, sep, raw = text.partition("=")
    if not sep or not key:
        sys.exit(f"--ours_set {text!r}: expected KEY=VALUE, e.g. loss.old_logp=detached")
    try:
        return key, json.loads(raw)
    except json.JSONDecodeError:
        return key, raw


def main():
    args = parse_args()
    if args.json_in:
        with open(args.json_in) as f:
            saved = json.load(f)
        report(saved["hf_config"], saved["spec"], saved["results"])
        return
    work = tempfile.mkdtemp(prefix="bench_peers_")
    model_dir = os.path.join(work, "model")
    hf = build_model(model_dir, args.seed)
    spec = {
        "model_dir": model_dir,
        "prompts": workload.prompts(args.prompts),
        "group_size": args.group_size,
        "max_new_tokens": args.max_new_tokens,
        "warmup": args.warmup,
        "steps": args.steps,
        "lr": args.lr,
        "weight_decay": 0.0,
        "grad_clip": 1.0,
        "seed": args.seed,
        "threads": os.cpu_count(),
        "ours_overrides": dict(parse_override(o) for o in args.ours_set),
    }
    spec_path = os.path.join(work, "spec.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    print(
        f"workload: {num_params(hf):,}-parameter Qwen2 in {model_dir}; {args.prompts} prompts x "
        f"G={args.group_size}, <= {args.max_new_tokens} new tokens, {args.warmup} warm-up + "
        f"{args.steps} timed steps; {os.cpu_count()} CPUs",
        flush=True,
    )
    pythons = {"ours": args.ours_python, "trl": args.trl_python, "tunix": args.tunix_python}
    results = {}
    for name in args.impls.split(","):
        result = run_peer(name, pythons[name], spec_path, work, args.timeout)
        if result is not None:
            results[name] = result
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"hf_config": hf, "spec": spec, "results": results}, f, indent=1)
    report(hf, spec, results)
    if len(results) < len(args.impls.split(",")):
        sys.exit("some implementations failed: see their logs above")


def report(hf: dict, spec: dict, results: dict) -> None:
    """Prints each implementation's settings, the table and our roofline."""
    for name, r in results.items():
        print(f"{name}: {json.dumps(r['settings'])}")
    print(table(results))
    if "ours" in results:
        prompts = spec["prompts"]
        print(roofline(hf, results["ours"], len(prompts), spec["group_size"], len(prompts[0])))


if __name__ == "__main__":
    main()

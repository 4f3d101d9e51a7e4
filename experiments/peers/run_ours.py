"""dapo_jax on the reference workload: `dapo_jax.train.train` with `configs/dapo.py:tiny` and the
workload's overrides; the step times are the trainer's own `timing/*` metrics (metrics.jsonl).

    python experiments/peers/run_ours.py SPEC.json

Also measures this machine's dense f32 matmul rate (jax, the same process) for the roofline.
"""

import json
import math
import os
import sys
import tempfile
import time

# The tiny config as `make demo` runs it: the 2-core CPU as 2 XLA devices (before JAX starts)
os.environ.setdefault("JAX_NUM_CPU_DEVICES", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import workload  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def config(spec: dict, data_file: str):
    """`configs/dapo.py:tiny` set to the workload: no evaluation, no filter, no overlong
    penalty, one update on the whole batch a step, a constant learning rate."""
    sys.path.insert(0, REPO)
    from configs import dapo  # pylint: disable=import-outside-toplevel

    c = dapo.get_config("tiny")
    n, g = len(spec["prompts"]), spec["group_size"]
    width = max(len(p) for p in spec["prompts"])
    c.model.path = spec["model_dir"]
    c.data.update(
        train_files=(data_file,),
        eval_files=(),
        prompt_template="{problem}",
        use_chat_template=False,
        dedup=False,
        max_prompt_len=width,
        prompt_buckets=(width,),
    )
    c.rollout.update(
        group_size=g, temperature=1.0, top_p=1.0, top_k=None, max_new_tokens=spec["max_new_tokens"]
    )
    c.reward.update(
        fn=os.path.join(os.path.dirname(os.path.abspath(__file__)), "workload.py") + ":char_reward",
        overlong_penalty=False,
        overlong_buffer=1,
        num_workers=1,
    )
    c.filter.update(enable=False, gen_batch_prompts=n)
    # One update per rollout batch: log pi_old is the detached current log-prob, as in TRL and Tunix.
    c.loss.update(
        eps_low=0.2, eps_high=0.28, clip_ratio_c=None, agg_mode="token-mean", beta=0.0, old_logp="detached"
    )
    c.optim.update(
        lr=spec["lr"], warmup_rollout_steps=0, schedule="constant", weight_decay=spec["weight_decay"]
    )
    c.optim.grad_clip = spec["grad_clip"]
    c.train.update(
        steps=spec["warmup"] + spec["steps"],
        train_batch_prompts=n,
        mini_batch_prompts=n,
        # the tiny config's micro-batches of 16 (a divisor of a smaller batch): gradient
        # accumulation, still one update
        micro_batch_size=math.gcd(c.train.micro_batch_size, n * g),
    )
    c.checkpoint.update(every=10_000)
    c.eval.update(every=None, at_start=False)
    c.metrics.update(writers="jsonl", completions_every=None)
    c.seed = spec["seed"]
    from dapo_jax import overrides  # pylint: disable=import-outside-toplevel

    return overrides.apply(c, spec.get("ours_overrides", {}))


def matmul_gflops(n: int = 1024, reps: int = 20) -> float:
    """The best rate of an n x n x n f32 matmul on this machine, GFLOP/s."""
    import jax  # pylint: disable=import-outside-toplevel
    import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        f(a).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best / 1e9


def main():
    spec = workload.read_spec(sys.argv[1])
    from dapo_jax import cli, hf_io, train  # pylint: disable=import-outside-toplevel

    workload.check_round_trip(hf_io.load_tokenizer(spec["model_dir"]))
    work = tempfile.mkdtemp(prefix="bench_ours_")
    data_file = os.path.join(work, "prompts.jsonl")
    with open(data_file, "w") as f:
        for p in spec["prompts"]:
            row = {"prompt": [{"role": "user", "content": p}], "reward_model": {"ground_truth": "0"}}
            f.write(json.dumps(row) + "\n")
    c = config(spec, data_file)
    cli.quiet_logging()
    train.train(c, os.path.join(work, "run"))
    batch = len(spec["prompts"]) * spec["group_size"]
    steps = []
    with open(os.path.join(work, "run", "metrics.jsonl")) as f:
        for line in f:
            m = json.loads(line)
            if "timing/step_s" in m:
                steps.append(
                    {
                        "step_s": m["timing/step_s"],
                        "gen_s": m["timing/rollout_s"],
                        "update_s": m["timing/train_s"],
                        "tokens": m["data/response_length_mean"] * batch,
                        "truncated": m["data/truncated_fraction"],
                    }
                )
    import jax  # pylint: disable=import-outside-toplevel

    from dapo_jax import train_step  # pylint: disable=import-outside-toplevel

    settings = {
        "version": "dapo_jax (this checkout)",
        "jax": jax.__version__,
        "dtype": f"{c.model.dtype} compute, {c.model.param_dtype} params",
        "config": "configs/dapo.py:tiny + the workload's overrides",
        "overrides": spec.get("ours_overrides", {}),
        "micro_batch_size": c.train.micro_batch_size,
        "length_bucket": train_step.length_bucket(max(c.data.prompt_buckets) + c.rollout.max_new_tokens),
        "matmul_gflops": matmul_gflops(),
    }
    workload.emit("ours", spec, steps, settings)


if __name__ == "__main__":
    main()

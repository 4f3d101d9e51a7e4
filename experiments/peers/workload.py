"""The reference workload that `bench_peers.py` runs on every implementation: the model, the
prompts, the reward, the spec file and the one JSON line a runner prints. Standard library only:
each peer's virtualenv imports it (the runners put this folder on `sys.path`).
"""

import json
import resource
import statistics
import sys
import time

DIGITS = "0123456789"
# The benchmark model, a random Qwen2 of 1.02M parameters, as the config.json that every
# implementation loads; bench_rollout.py and bench_update.py build the same one. Vocabulary and
# special ids are those of make_tiny_model.py's character tokenizer (its shipped model is this
# one with 4 layers).
HF_CONFIG = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "vocab_size": 128,
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 5,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "hidden_act": "silu",
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "use_sliding_window": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}


def prompts(n: int) -> list[str]:
    """`n` distinct prompts of one length (18 characters), so no implementation pads them."""
    return [f"What is {100 + 37 * i:3d} + {200 + 53 * i:3d}?" for i in range(n)]


def digit_fraction(response: str) -> float:
    """The reward of a response: the share of its characters that are digits, in [0, 1].
    Deterministic, cheap, and spread out on a random model's samples."""
    return sum(ch in DIGITS for ch in response) / max(len(response), 1)


def char_reward(response: str, ground_truth: str, *, data_source: str = "", extra_info=None) -> float:
    """`digit_fraction` as a dapo_jax reward plug-in (`reward.fn = ".../workload.py:char_reward"`)."""
    del ground_truth, data_source, extra_info
    return digit_fraction(response)


def reward(prompts, completions, **kwargs) -> list[float]:
    """`digit_fraction` as TRL's and Tunix's reward function: one float per completion."""
    del prompts, kwargs
    return [digit_fraction(c) for c in completions]


def read_spec(path: str) -> dict:
    """The workload a runner is given (written by `bench_peers.py`): model_dir, prompts,
    group_size, max_new_tokens, warmup, steps, lr, weight_decay, grad_clip, seed, threads."""
    with open(path) as f:
        return json.load(f)


def check_round_trip(tokenizer) -> None:
    """Exits when the tokenizer does not encode and decode a string with spaces exactly (a
    character tokenizer loaded as Qwen2Tokenizer drops them)."""
    text = "What is 1 + 2?  A  b\nc"
    ids = tokenizer.encode(text, add_special_tokens=False)
    back = tokenizer.decode(ids)
    if back != text or len(ids) != len(text):
        sys.exit(f"tokenizer round trip failed: {text!r} -> {len(ids)} ids -> {back!r}")


def peak_rss_mib() -> float:
    """The peak resident set size of this process so far, MiB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class StepTimer:
    """Per step the record that `emit` reads: step_s, gen_s (the generation calls inside the step),
    update_s = step_s - gen_s, and the response tokens generated. A runner calls `begin` and `end`
    around a step, or wraps its framework's step and generation calls."""

    def __init__(self):
        self.steps: list[dict] = []
        self.gen_s, self.tokens, self._t0 = 0.0, 0, 0.0

    def begin(self) -> None:
        self.gen_s, self.tokens, self._t0 = 0.0, 0, time.perf_counter()

    def end(self) -> None:
        step_s = time.perf_counter() - self._t0
        gen_s, tokens = self.gen_s, self.tokens
        self.steps.append({"step_s": step_s, "gen_s": gen_s, "update_s": step_s - gen_s, "tokens": tokens})

    def wrap_generation(self, generate, tokens, ready=lambda out: None):
        """`generate`, its time (until `ready(out)` returns) added to gen_s and `tokens(out)` to
        the step's tokens."""

        def timed(*args, **kwargs):
            t = time.perf_counter()
            out = generate(*args, **kwargs)
            ready(out)
            self.gen_s += time.perf_counter() - t
            self.tokens += tokens(out)
            return out

        return timed

    def wrap_step(self, step, ready):
        """`step`, timed as one step until `ready()` returns."""

        def timed(*args, **kwargs):
            self.begin()
            out = step(*args, **kwargs)
            ready()
            self.end()
            return out

        return timed


def emit(impl: str, spec: dict, steps: list[dict], settings: dict) -> None:
    """Prints the runner's one JSON line: per timed step gen_s, update_s, step_s and the
    response tokens generated (= trained: every response token is in the loss), the medians, the
    peak RSS and the implementation's settings."""
    timed = steps[spec["warmup"] :]
    result = {
        "impl": impl,
        "steps": timed,
        "warmup_steps": steps[: spec["warmup"]],
        "peak_rss_mib": peak_rss_mib(),
        "settings": settings,
    }
    for key in ("step_s", "gen_s", "update_s", "tokens"):
        result[key] = statistics.median(s[key] for s in timed)
    print("BENCH_JSON " + json.dumps(result), flush=True)

"""Test-wide setup: eight fake CPU devices (set before jax is imported), one compilation cache
per session, and tiny HF reference models."""

import atexit
import os
import shutil
import tempfile

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
# A persistent XLA compilation cache for this session only, inherited by the processes the tests
# start: the tiny config's programs, compiled again by every run, resume and subprocess (a new
# jit each time), compile once. A fresh folder per session, so no entry outlives it.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _XLA_CACHE = tempfile.mkdtemp(prefix="dapo-jax-tests-xla-")
    atexit.register(shutil.rmtree, _XLA_CACHE, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _XLA_CACHE
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402

from configs import ablation  # noqa: E402


def build_hf_model(arch: str, out_dir: str, **overrides) -> str:
    """Save a random tiny `Qwen2ForCausalLM`, `Qwen3ForCausalLM` or `LlamaForCausalLM` (torch,
    f32) to `out_dir`."""
    import torch
    import transformers

    torch.manual_seed(0)
    common = dict(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )
    common.update(overrides)
    classes = {
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    }
    config_cls, model_cls = classes[arch]
    model = model_cls(config_cls(**common))
    with torch.no_grad():  # random, non-zero biases and norm scales so that they are tested too
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="session")
def qwen2_dir(tmp_path_factory):
    return build_hf_model("qwen2", str(tmp_path_factory.mktemp("qwen2")))


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory):
    return build_hf_model("llama", str(tmp_path_factory.mktemp("llama")))


@pytest.fixture(scope="session")
def qwen3_dir(tmp_path_factory):
    """Qwen3 as its small sizes are: tied embeddings, and head_dim (24) apart from
    hidden_size / num_attention_heads (16). Weights of std 0.2: at 0.02 the tied head's logits
    favour the input token and greedy decoding repeats one token."""
    return build_hf_model(
        "qwen3",
        str(tmp_path_factory.mktemp("qwen3")),
        head_dim=24,
        tie_word_embeddings=True,
        initializer_range=0.2,
    )


@pytest.fixture
def attention_blocks(monkeypatch):
    """`attention_blocks(c)`: the model's multi-token attention traced from then on in blocks of
    c queries (0: one block), in place of `model.attention_block`'s and `model.SEGMENT_BLOCK`'s
    (one block at test sizes)."""
    from dapo_jax import model  # noqa: PLC0415 (after XLA_FLAGS)

    def blocks(chunk):
        monkeypatch.setattr(model, "attention_block", lambda t, s: chunk or t)
        monkeypatch.setattr(model, "SEGMENT_BLOCK", chunk or 2**31)

    return blocks


# Metrics that measure time or count the reward workers' life, not the run's maths.
WALL_CLOCK = ("timing/", "throughput/", "reward/")

# A tiny DAPO config shrunk to test size: the ablation's QUICK sizes (their shapes divide the 8
# fake devices), one step, no evaluation, a checkpoint after the step.
SMALL = {
    **ablation.QUICK,
    "train.steps": 1,
    "eval.at_start": False,
    "eval.every": None,
    "checkpoint.every": 1,
}


def small(config, **overrides):
    """`config` with SMALL and then `overrides` ({"section__field": value}) applied."""
    from dapo_jax import overrides as dotted

    return dotted.apply(config, {**SMALL, **{k.replace("__", "."): v for k, v in overrides.items()}})


def small_flags(**overrides) -> list[str]:
    """SMALL and `overrides` as `--config.section.field=value` command-line flags."""
    merged = {**SMALL, **{k.replace("__", "."): v for k, v in overrides.items()}}
    return [f"--config.{k}={v}" for k, v in merged.items()]

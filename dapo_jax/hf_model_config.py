"""A Hugging Face config.json as our `ModelConfig`, checked: untrusted input, every failure a
one-line `ModelFolderError` naming the file and the key.

Families (`FAMILIES`): Qwen2/Qwen2.5, Qwen3 dense, Llama 2/3/3.1. `config_from_hf` checks JSON;
`architectures` one supported family and `model_type` the same; the sizes positive integers,
heads a multiple of KV heads, `head_dim` given or implied, even; silu, full attention, no
quantization; RoPE default or llama3. `check_vocab`: the tokenizer no larger than `vocab_size`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import NamedTuple

from dapo_jax.errors import ModelFolderError
from dapo_jax.model import ModelConfig


class Family(NamedTuple):
    """What an architecture's name implies beyond its config.json keys."""

    model_type: str  # config.json's model_type must say the same
    qkv_bias: bool  # q/k/v projections always carry biases (Qwen2)
    qk_norm: bool  # RMSNorm of each q and k head before RoPE (Qwen3)


FAMILIES = {
    "Qwen2ForCausalLM": Family("qwen2", qkv_bias=True, qk_norm=False),  # Qwen2, Qwen2.5
    "Qwen3ForCausalLM": Family("qwen3", qkv_bias=False, qk_norm=True),  # Qwen3 dense
    "LlamaForCausalLM": Family("llama", qkv_bias=False, qk_norm=False),  # Llama 2, 3, 3.1
}


def json_file(path: str, what: str):
    """The parsed JSON file at `path`, or a ModelFolderError saying what it should have been."""
    try:
        with open(path, "rb") as f:
            return json.loads(f.read())
    except OSError as e:
        raise ModelFolderError(path, f"cannot be read ({e.strerror})") from None
    except (UnicodeDecodeError, ValueError) as e:
        raise ModelFolderError(path, f"is not valid JSON ({e}); {what}") from None


def read_hf_config(model_dir: str) -> dict:
    """The raw config.json of a model directory."""
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise ModelFolderError(
            path,
            "does not exist: pass a Hugging Face model directory holding config.json and model.safetensors",
        )
    hf = json_file(path, "restore the model's config.json")
    if not isinstance(hf, dict):
        raise ModelFolderError(path, "is not a JSON object; restore the model's config.json")
    return hf


def _positive_int(hf: Mapping, key: str, source: str, default=None) -> int:
    value = default if hf.get(key) is None else hf[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        found = repr(hf[key]) if key in hf else "missing"
        raise ModelFolderError(source, f"{key} is {found}: a positive integer is needed")
    return value


def _rope(hf: Mapping, source: str) -> tuple[float, tuple | None]:
    """(rope_theta, llama3 scaling or None) from transformers 5's rope_parameters or 4's
    rope_scaling and rope_theta: the two RoPE variants the model implements."""
    key = "rope_parameters" if hf.get("rope_parameters") else "rope_scaling"
    rope = hf.get(key) or {}
    if not isinstance(rope, dict):
        raise ModelFolderError(source, f"{key} is {rope!r}: a JSON object or null is needed")
    theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
        raise ModelFolderError(source, f"rope_theta is {theta!r}: a positive number is needed")
    partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ModelFolderError(
            source, f"partial_rotary_factor {partial!r} is not supported (RoPE over whole heads only)"
        )
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "default":
        return float(theta), None
    if rope_type != "llama3":
        raise ModelFolderError(source, f"{key}.rope_type {rope_type!r} is not supported (default, llama3)")
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    for k in keys:
        if isinstance(rope.get(k), bool) or not isinstance(rope.get(k), (int, float)):
            raise ModelFolderError(source, f"{key}.{k} is {rope.get(k)!r}: llama3 RoPE needs a number")
    return float(theta), tuple((k, float(rope[k])) for k in keys)


# config.json sizes without a default: each a positive int
_REQUIRED_SIZES = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
)


def _family(hf: Mapping, source: str) -> Family:
    """The supported family `hf` (a config.json) declares, after checking that nothing it asks
    for (quantization, another activation, sliding windows, biases) is beyond what we load."""
    bad = lambda problem: ModelFolderError(source, problem)
    archs = hf.get("architectures")
    if not isinstance(archs, list) or len(archs) != 1 or archs[0] not in FAMILIES:
        raise bad(f"architectures {archs!r} is not supported; supported: {sorted(FAMILIES)}")
    family = FAMILIES[archs[0]]
    if hf.get("model_type") != family.model_type:
        raise bad(
            f"model_type {hf.get('model_type')!r} disagrees with architectures {archs} "
            f"(model_type {family.model_type!r}): fix whichever of the two is wrong"
        )
    if hf.get("quantization_config") is not None:
        raise bad(
            "quantization_config: quantized checkpoints are not supported; load the "
            "unquantized (bf16 or f32) weights"
        )
    if hf.get("hidden_act", "silu") != "silu":
        raise bad(f"hidden_act {hf['hidden_act']!r} is not supported (silu only)")
    if hf.get("use_sliding_window") or any(t != "full_attention" for t in hf.get("layer_types") or ()):
        raise bad("use_sliding_window / layer_types: sliding-window attention is not supported")
    if hf.get("attention_bias") and not family.qkv_bias:
        raise bad(f"attention_bias true (q/k/v/o biases) is not supported for {archs[0]}")
    return family


def config_from_hf(
    hf: Mapping,
    *,
    dtype="bfloat16",
    param_dtype="float32",
    remat=None,
    source="config.json",
    **numerics,
) -> ModelConfig:
    """ModelConfig from a Qwen2/Qwen2.5, Qwen3 (dense) or Llama config.json (transformers 4 or 5
    layout). Every key it reads is checked first; a ModelFolderError names `source` and the key."""
    family = _family(hf, source)
    bad = lambda problem: ModelFolderError(source, problem)
    ints = {k: _positive_int(hf, k, source) for k in _REQUIRED_SIZES}
    heads, hidden = ints["num_attention_heads"], ints["hidden_size"]
    kv_heads = _positive_int(hf, "num_key_value_heads", source, default=heads)
    if heads % kv_heads:
        raise bad(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
    if hf.get("head_dim") is None and hidden % heads:
        raise bad(
            f"head_dim is not given and hidden_size {hidden} is not a multiple of num_attention_heads {heads}"
        )
    head_dim = _positive_int(hf, "head_dim", source, default=hidden // heads)
    if head_dim % 2:
        raise bad(f"head_dim {head_dim} is odd: RoPE rotates pairs of channels")
    eps = hf.get("rms_norm_eps", 1e-6)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or eps <= 0:
        raise bad(f"rms_norm_eps is {eps!r}: a positive number is needed")
    if not isinstance(hf.get("tie_word_embeddings", False), bool):
        raise bad(f"tie_word_embeddings is {hf['tie_word_embeddings']!r}: true or false")
    theta, scaling = _rope(hf, source)
    return ModelConfig(
        vocab_size=ints["vocab_size"],
        hidden_size=hidden,
        intermediate_size=ints["intermediate_size"],
        num_layers=ints["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(eps),
        rope_theta=theta,
        rope_scaling=scaling,
        qkv_bias=family.qkv_bias,
        qk_norm=family.qk_norm,
        mlp_bias=family.model_type == "llama" and bool(hf.get("mlp_bias", False)),
        tie_word_embeddings=hf.get("tie_word_embeddings", False),
        dtype=dtype,
        param_dtype=param_dtype,
        remat=remat,
        **numerics,  # scan_layers, transposed_keys
    )


def check_vocab(config: ModelConfig, tokenizer, source: str) -> None:
    """Every id the tokenizer can produce has a row in the embedding."""
    if len(tokenizer) > config.vocab_size:
        raise ModelFolderError(
            source,
            f"vocab_size {config.vocab_size} is smaller than the "
            f"tokenizer's {len(tokenizer)} tokens: ids past it have no "
            "embedding; use the tokenizer that belongs to this model",
        )

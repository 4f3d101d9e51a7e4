"""A run's ModelConfig without its checkpoint, for compiling ahead of time (`dapo_jax.aot`): the
config.json of the models the shipped configs name (`KNOWN_MODELS`, values from the models' Hub
config files); a model folder's own config.json wins."""

from __future__ import annotations

import os

from dapo_jax import hf_model_config, model, run
from dapo_jax.errors import ConfigError

_QWEN = dict(
    hidden_act="silu",
    rms_norm_eps=1e-6,
    rope_theta=1e6,
    tie_word_embeddings=False,
    max_position_embeddings=131072,
)
KNOWN_MODELS = {
    "Qwen2.5-32B": dict(
        _QWEN,
        architectures=["Qwen2ForCausalLM"],
        model_type="qwen2",
        vocab_size=152064,
        hidden_size=5120,
        intermediate_size=27648,
        num_hidden_layers=64,
        num_attention_heads=40,
        num_key_value_heads=8,
        rms_norm_eps=1e-5,
    ),
    "Qwen2.5-7B": dict(
        _QWEN,
        architectures=["Qwen2ForCausalLM"],
        model_type="qwen2",
        vocab_size=152064,
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
    ),
    "Qwen3-8B-Base": dict(
        _QWEN,
        architectures=["Qwen3ForCausalLM"],
        model_type="qwen3",
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=32768,
    ),
}


def model_config(c) -> model.ModelConfig:
    """The run's ModelConfig: the model folder's config.json, or `KNOWN_MODELS` by folder name."""
    path = os.path.join(c.model.path, "config.json")
    if os.path.isfile(path):
        hf = hf_model_config.read_hf_config(c.model.path)
    elif os.path.basename(c.model.path.rstrip("/")) in KNOWN_MODELS:
        hf = KNOWN_MODELS[os.path.basename(c.model.path.rstrip("/"))]
    else:
        raise ConfigError(
            f"model.path {c.model.path!r} has no config.json here and is not one "
            f"of {sorted(KNOWN_MODELS)}: copy its config.json there"
        )
    return hf_model_config.config_from_hf(hf, source=path, **run.model_numerics(c))

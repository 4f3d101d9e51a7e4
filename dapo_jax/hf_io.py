"""Hugging Face checkpoints in and out: config.json <-> ModelConfig, safetensors <-> sharded params.

Weights are read from safetensors only (never pickle) and straight into their shards: each process
reads just the slices that its own devices hold (`jax.make_array_from_callback` over memory-mapped
safetensors slices), so the full model never sits unsharded on one host. Saving writes the
Hugging Face layout (sharded files plus `model.safetensors.index.json`) that transformers and vLLM load.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
from collections.abc import Mapping

import jax
import numpy as np
import transformers
from flax import traverse_util
from safetensors import safe_open
from safetensors.numpy import save_file

from dapo_jax import sharding
from dapo_jax.model import ModelConfig, Transformer

SUPPORTED_ARCHITECTURES = {"Qwen2ForCausalLM": "qwen2", "LlamaForCausalLM": "llama"}
_SINGLE_FILE = "model.safetensors"
_INDEX_FILE = "model.safetensors.index.json"
_IGNORED_TENSORS = re.compile(r".*rotary_emb\.inv_freq$")


def read_hf_config(model_dir: str) -> dict:
    """The raw config.json of a model directory."""
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} does not exist: pass a Hugging Face model directory "
                                "holding config.json and model.safetensors")
    with open(path) as f:
        return json.load(f)


def config_from_hf(hf: Mapping, *, dtype="bfloat16", param_dtype="float32", remat=False,
                   attention_chunk=0, source="config.json") -> ModelConfig:
    """ModelConfig from a Qwen2/Qwen2.5 or Llama config.json (transformers 4 or 5 layout)."""
    archs = hf.get("architectures") or []
    if len(archs) != 1 or archs[0] not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"{source}: architecture {archs} is not supported; "
                         f"supported: {sorted(SUPPORTED_ARCHITECTURES)}")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{source}: hidden_act {hf['hidden_act']!r} is not supported (silu only)")
    if hf.get("use_sliding_window"):
        raise ValueError(f"{source}: sliding-window attention is not supported")
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "llama3":
        keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        scaling = tuple((k, float(rope[k])) for k in keys)
    elif rope_type == "default":
        scaling = None
    else:
        raise ValueError(f"{source}: rope_type {rope_type!r} is not supported (default, llama3)")
    qwen = SUPPORTED_ARCHITECTURES[archs[0]] == "qwen2"
    heads = hf["num_attention_heads"]
    return ModelConfig(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=float(theta),
        rope_scaling=scaling,
        qkv_bias=True if qwen else bool(hf.get("attention_bias", False)),
        mlp_bias=False if qwen else bool(hf.get("mlp_bias", False)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_position_embeddings=hf.get("max_position_embeddings", 32768),
        dtype=dtype,
        param_dtype=param_dtype,
        remat=remat,
        attention_chunk=attention_chunk,
    )


def hf_name(path: tuple[str, ...]) -> tuple[str, bool]:
    """Our parameter path -> (Hugging Face tensor name, whether the kernel is transposed)."""
    *modules, leaf = path
    if modules == ["lm_head"]:
        return "lm_head.weight", True
    names = [re.sub(r"^layers_(\d+)$", r"layers.\1", m) for m in modules]
    suffix = {"kernel": "weight", "embedding": "weight", "scale": "weight", "bias": "bias"}[leaf]
    return ".".join(["model", *names, suffix]), leaf == "kernel"


def _tensor_files(model_dir: str) -> dict[str, str]:
    """Tensor name -> safetensors file, from the index of a sharded checkpoint or the single file."""
    index = os.path.join(model_dir, _INDEX_FILE)
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        return {name: os.path.join(model_dir, file) for name, file in weight_map.items()}
    single = os.path.join(model_dir, _SINGLE_FILE)
    if not os.path.isfile(single):
        raise FileNotFoundError(
            f"{model_dir} holds neither {_SINGLE_FILE} nor {_INDEX_FILE}; weights load from "
            "safetensors only (convert .bin/.pt checkpoints with transformers' save_pretrained)")
    with safe_open(single, framework="numpy") as f:
        return {name: single for name in f.keys()}


def load_params(model_dir: str, model: Transformer, mesh) -> dict:
    """Read a Hugging Face safetensors checkpoint into parameters sharded on `mesh` by `RULES`."""
    files = _tensor_files(model_dir)
    shardings = traverse_util.flatten_dict(sharding.param_shardings(model, mesh))
    abstract = traverse_util.flatten_dict(sharding.abstract_params(model))
    dtype = model.config.weight_dtype
    params, used = {}, set()
    with contextlib.ExitStack() as stack:
        handles = {f: stack.enter_context(safe_open(f, framework="numpy")) for f in set(files.values())}
        for path, leaf in abstract.items():
            name, transposed = hf_name(path)
            if name not in files:
                raise KeyError(f"{model_dir}: tensor {name} is missing from the checkpoint "
                               f"(needed for parameter {'/'.join(path)})")
            view = handles[files[name]].get_slice(name)
            want = leaf.shape[::-1] if transposed else leaf.shape
            if tuple(view.get_shape()) != tuple(want):
                raise ValueError(f"{files[name]}: tensor {name} has shape {tuple(view.get_shape())} "
                                 f"but config.json implies {tuple(want)}")

            def read(index, view=view, transposed=transposed):
                block = view[index[::-1]].T if transposed else view[index]
                return np.ascontiguousarray(block).astype(dtype)

            params[path] = jax.make_array_from_callback(leaf.shape, shardings[path], read)
            used.add(name)
    unused = sorted(n for n in files if n not in used and not _IGNORED_TENSORS.match(n))
    if unused:
        logging.warning("%s: %d checkpoint tensors are not used: %s", model_dir, len(unused), unused[:8])
    return traverse_util.unflatten_dict(params)


def save_params(params, hf_config: Mapping, out_dir: str, *, dtype: str | None = None,
                max_shard_bytes: int = 5 * 2**30) -> None:
    """Write `params` as a Hugging Face checkpoint: config.json and (sharded) safetensors.

    Every process joins the gather of sharded arrays; only process 0 writes.
    """
    flat = traverse_util.flatten_dict(params)
    np_dtype = np.dtype(jax.numpy.dtype(dtype)) if dtype else None
    tensors = {}
    for path, x in flat.items():
        host = sharding.to_host(x)
        name, transposed = hf_name(path)
        host = host.T if transposed else host
        tensors[name] = np.ascontiguousarray(host.astype(np_dtype) if np_dtype else host)
    if jax.process_index() != 0:
        return
    os.makedirs(out_dir, exist_ok=True)
    shards, current, size = [], {}, 0
    for name in sorted(tensors):
        if current and size + tensors[name].nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = tensors[name]
        size += tensors[name].nbytes
    shards.append(current)
    if len(shards) == 1:
        save_file(shards[0], os.path.join(out_dir, _SINGLE_FILE), metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, os.path.join(out_dir, file), metadata={"format": "pt"})
            weight_map.update({name: file for name in shard})
        total = sum(t.nbytes for t in tensors.values())
        with open(os.path.join(out_dir, _INDEX_FILE), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    config = dict(hf_config)
    config["dtype"] = str(np.dtype(next(iter(tensors.values())).dtype))
    config.pop("torch_dtype", None)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)


def load_tokenizer(path: str) -> transformers.PreTrainedTokenizerBase:
    """The tokenizer of a local directory, chat template included; never runs remote code.

    A tokenizer saved as a plain fast tokenizer (`PreTrainedTokenizerFast`, transformers 5's
    `TokenizersBackend`) is loaded as one: `AutoTokenizer` would otherwise pick the class from
    config.json's model type (Qwen2Tokenizer) and silently drop a custom tokenizer's spaces.
    """
    if not os.path.isdir(path):
        raise FileNotFoundError(f"tokenizer directory {path} does not exist")
    config_path = os.path.join(path, "tokenizer_config.json")
    declared = None
    if os.path.isfile(config_path):
        with open(config_path) as f:
            declared = json.load(f).get("tokenizer_class")
    if declared in ("PreTrainedTokenizerFast", "TokenizersBackend"):
        return transformers.PreTrainedTokenizerFast.from_pretrained(path)
    return transformers.AutoTokenizer.from_pretrained(path, trust_remote_code=False)

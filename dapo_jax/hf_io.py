"""Hugging Face checkpoints in and out: config.json <-> ModelConfig, safetensors <-> sharded params.

Families (`FAMILIES`): Qwen2/Qwen2.5, Qwen3 dense, Llama 2/3/3.1. A model folder is untrusted
input, checked before any weight is read, and every failure is a one-line `ModelFolderError`
naming the file and the key or tensor:
  1. config.json (`config_from_hf`): JSON; `architectures` one supported family and `model_type`
     the same; the sizes positive integers, heads a multiple of KV heads, `head_dim` given or
     implied, even; silu, full attention, no quantization; RoPE default or llama3;
  2. the safetensors headers (`safetensors_header`), sized against their files; a sharded
     index's shards present and holding what it maps to them;
  3. strict loading (`check_tensors`): the layers are `num_hidden_layers`, every tensor feeds a
     parameter of its shape (else the config.json keys behind it are named) and a float dtype, or
     is on the short list of tensors known to be unused (`_UNUSED_TENSORS`), and no parameter
     lacks one;
  4. the tokenizer (`load_tokenizer`, `check_vocab`): present, and no larger than `vocab_size`.
`check_model_folder` runs 1-3 without reading a weight; `load_params` runs 2-3 before it reads.

Weights are read from safetensors only (never pickle) and straight into their shards: each process
reads just the slices that its own devices hold (`jax.make_array_from_callback` over memory-mapped
safetensors slices), so the full model never sits unsharded on one host. Saving writes the
Hugging Face layout (sharded files plus `model.safetensors.index.json`) that transformers and vLLM
load.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
from collections.abc import Mapping
from typing import NamedTuple

import jax
import numpy as np
import transformers
from flax import traverse_util
from safetensors import SafetensorError, safe_open

from dapo_jax import sharding
from dapo_jax.errors import ModelFolderError
from dapo_jax.model import ModelConfig, Transformer
from dapo_jax.safetensors_header import REDO, TensorInfo, read_safetensors_header


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
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_WEIGHT_DTYPES = ("F64", "F32", "F16", "BF16")


def _json_file(path: str, what: str):
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
    hf = _json_file(path, "restore the model's config.json")
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
    remat=False,
    attention_chunk=0,
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
        attention_chunk=attention_chunk,
        **numerics,  # remat_policy, scan_layers, logits_chunk
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


def hf_name(path: tuple[str, ...]) -> tuple[str, bool]:
    """Our parameter path -> (Hugging Face tensor name, whether the kernel is transposed)."""
    *modules, leaf = path
    if modules == ["lm_head"]:
        return "lm_head.weight", True
    names = [re.sub(r"^layers_(\d+)$", r"layers.\1", m) for m in modules]
    suffix = {"kernel": "weight", "embedding": "weight", "scale": "weight", "bias": "bias"}[leaf]
    return ".".join(["model", *names, suffix]), leaf == "kernel"


def checkpoint_tensors(model_dir: str) -> dict[str, TensorInfo]:
    """Every tensor of a checkpoint, from the headers of model.safetensors or of the shards that
    model.safetensors.index.json names (each named tensor must be in its shard)."""
    index = os.path.join(model_dir, INDEX_FILE)
    if not os.path.isfile(index):
        single = os.path.join(model_dir, SINGLE_FILE)
        if not os.path.isfile(single):
            raise ModelFolderError(
                model_dir,
                f"holds neither {SINGLE_FILE} nor {INDEX_FILE}; "
                "weights load from safetensors only (convert .bin/.pt "
                "checkpoints with transformers' save_pretrained)",
            )
        return read_safetensors_header(single)
    weight_map = _json_file(index, REDO)
    weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
        raise ModelFolderError(index, f"has no weight_map of tensor names to shard files; {REDO}")
    tensors = {}
    for shard in sorted(set(weight_map.values())):
        path = os.path.join(model_dir, shard)
        if os.path.basename(shard) != shard or not os.path.isfile(path):
            raise ModelFolderError(
                index,
                f"names shard {shard!r}, which is not a file of {model_dir}; download the missing shard",
            )
        tensors.update(read_safetensors_header(path))
    for name, shard in weight_map.items():
        if name not in tensors or os.path.basename(tensors[name].file) != shard:
            raise ModelFolderError(index, f"maps tensor {name} to {shard}, which does not hold it; {REDO}")
    return tensors


# Tensors that checkpoints hold and no parameter reads: the only ones a load skips. RoPE's inverse
# frequencies are a buffer that older transformers saved; the model computes them from rope_theta.
_UNUSED_TENSORS = re.compile(r"model\.(layers\.\d+\.self_attn\.)?rotary_emb\.inv_freq")
_TIED_HEAD = "lm_head.weight"  # with tie_word_embeddings, usable only as the embedding's copy
_EMBEDDING = "model.embed_tokens.weight"
_LAYER = re.compile(r"model\.layers\.(\d+)\.")
# What sets each logical axis's size, to name the config.json keys behind a tensor's shape.
_AXIS_KEYS = {
    "vocab": "vocab_size",
    "embed": "hidden_size",
    "norm": "hidden_size",
    "mlp": "intermediate_size",
    "heads": "num_attention_heads x head_dim",
    "kv_heads": "num_key_value_heads x head_dim",
    "head_dim": "head_dim",
}


def _unrolled(model: Transformer) -> Transformer:
    """The model with its layers unrolled: the layout whose parameters map one to one onto
    checkpoint tensors (a scanned model's `layers` leaf of [L, ...] is L tensors)."""
    if not model.config.scan_layers:
        return model
    return Transformer(dataclasses.replace(model.config, scan_layers=False))


def layer_path(path: tuple[str, ...], i: int) -> tuple[str, ...]:
    """Layer i's unrolled path of a stacked parameter path ("layers", ...)."""
    return (f"layers_{i}", *path[1:])


def _expected_tensors(model: Transformer) -> dict[str, tuple]:
    """Tensor name -> (parameter path, checkpoint shape, config keys of its dimensions), for the
    unrolled layout."""
    model = _unrolled(model)
    abstract = traverse_util.flatten_dict(sharding.abstract_params(model))
    specs = traverse_util.flatten_dict(sharding.logical_param_specs(model))
    out = {}
    for path, leaf in abstract.items():
        name, transposed = hf_name(path)
        keys = [_AXIS_KEYS[a] for a in specs[path]]
        out[name] = (path, leaf.shape[::-1] if transposed else leaf.shape, keys[::-1] if transposed else keys)
    return out


def check_tensors(tensors: Mapping[str, TensorInfo], model: Transformer, model_dir: str) -> None:
    """Strict loading, from the headers alone: the checkpoint's layers are num_hidden_layers,
    every tensor feeds a parameter of its shape and a float dtype or is named in
    `_UNUSED_TENSORS` (or is a tied head's copy of the embedding), and no parameter lacks one."""
    config_json = os.path.join(model_dir, "config.json")
    c = model.config
    layers = {int(m.group(1)) for m in map(_LAYER.match, tensors) if m}
    if layers and max(layers) + 1 != c.num_layers:
        raise ModelFolderError(
            config_json,
            f"num_hidden_layers is {c.num_layers} but the weights "
            f"hold layers up to model.layers.{max(layers)}: fix "
            "num_hidden_layers or use the weights that belong to this config",
        )
    expected = _expected_tensors(model)
    tied_copy = (
        c.tie_word_embeddings
        and _TIED_HEAD in tensors
        and tensors[_TIED_HEAD].shape == (c.vocab_size, c.hidden_size)
    )
    unexpected = [
        n
        for n in sorted(tensors)
        if n not in expected and not _UNUSED_TENSORS.fullmatch(n) and not (tied_copy and n == _TIED_HEAD)
    ]
    if unexpected:
        raise ModelFolderError(
            tensors[unexpected[0]].file,
            f"{len(unexpected)} "
            f"tensor{'s' * (len(unexpected) > 1)} that no parameter reads: "
            f"{', '.join(unexpected[:4])}{', ...' * (len(unexpected) > 4)}; "
            "config.json's architectures or sizes do not describe these "
            "weights",
        )
    for name, (path, shape, keys) in expected.items():
        if name not in tensors:
            raise ModelFolderError(
                model_dir,
                f"tensor {name} is missing from the checkpoint "
                f"(parameter {'/'.join(path)}); the weights are not those of "
                "the architecture config.json names",
            )
        t = tensors[name]
        if t.shape != tuple(shape):
            raise ModelFolderError(
                t.file,
                f"tensor {name} has shape {t.shape} but config.json's "
                f"({', '.join(keys)}) say {tuple(shape)}: fix config.json or "
                "use the weights that belong to it",
            )
        if t.dtype not in _WEIGHT_DTYPES:
            raise ModelFolderError(
                t.file,
                f"tensor {name} is {t.dtype}, not a float dtype "
                f"{_WEIGHT_DTYPES}: quantized weights are not supported",
            )


def check_model_folder(model_dir: str, **numerics) -> tuple[dict, ModelConfig]:
    """config.json and the safetensors headers of a model folder checked as a load checks them,
    no weight read: returns the raw config and the ModelConfig (`numerics`: its dtype, remat...)."""
    hf = read_hf_config(model_dir)
    config = config_from_hf(hf, source=os.path.join(model_dir, "config.json"), **numerics)
    check_tensors(checkpoint_tensors(model_dir), Transformer(config), model_dir)
    return hf, config


def _open(stack: contextlib.ExitStack, path: str):
    try:
        return stack.enter_context(safe_open(path, framework="numpy"))
    except (SafetensorError, OSError) as e:
        raise ModelFolderError(path, f"cannot be read ({e}); {REDO}") from None


def _check_tied_copy(handles, tensors: Mapping[str, TensorInfo], rows: int = 4096) -> None:
    """A tied model's stored head must equal its embedding: transformers reads such a head as a
    separate weight when it differs, and this model cannot."""
    head, embed = (handles[tensors[n].file].get_slice(n) for n in (_TIED_HEAD, _EMBEDDING))
    vocab = tensors[_TIED_HEAD].shape[0]
    for start in range(0, vocab, rows):
        block = slice(start, min(start + rows, vocab))  # safetensors slices do not clip
        if not np.array_equal(head[block], embed[block]):
            raise ModelFolderError(
                tensors[_TIED_HEAD].file,
                f"tensor {_TIED_HEAD} differs from "
                f"{_EMBEDDING} but config.json's tie_word_embeddings is "
                "true: set it to false",
            )


def _reader(handles, tensors, name: str, transposed: bool, dtype):
    """`read(index) -> block`: the slice `index` of tensor `name` (transposed for kernels) in
    `dtype`, read from its memory-mapped safetensors file."""
    view = handles[tensors[name].file].get_slice(name)

    def read(index):
        try:
            block = view[index[::-1]].T if transposed else view[index]
        except SafetensorError as e:
            raise ModelFolderError(
                tensors[name].file, f"tensor {name} cannot be read ({e}); {REDO}"
            ) from None
        return np.ascontiguousarray(block).astype(dtype)

    return read


def _stacked_reader(layer_reads):
    """`read(index)` of a stacked [L, ...] parameter: index[0] picks layers, each read by its own
    tensor's reader with the rest of the index."""

    def read(index):
        layers = range(*index[0].indices(len(layer_reads)))
        return np.stack([layer_reads[i](index[1:]) for i in layers])

    return read


def load_params(model_dir: str, model: Transformer, mesh) -> dict:
    """Read a Hugging Face safetensors checkpoint into parameters sharded on `mesh` by `RULES`,
    after `check_tensors` has passed on its headers. A scanned model's stacked `layers` leaves
    are read layer by layer from the per-layer tensors."""
    tensors = checkpoint_tensors(model_dir)
    check_tensors(tensors, model, model_dir)
    shardings = traverse_util.flatten_dict(sharding.param_shardings(model, mesh))
    abstract = traverse_util.flatten_dict(sharding.abstract_params(model))
    dtype = model.config.weight_dtype
    params = {}
    with contextlib.ExitStack() as stack:
        handles = {f: _open(stack, f) for f in sorted({t.file for t in tensors.values()})}
        if model.config.tie_word_embeddings and _TIED_HEAD in tensors:
            _check_tied_copy(handles, tensors)
        for path, leaf in abstract.items():
            if path[0] == "layers":
                read = _stacked_reader(
                    [
                        _reader(handles, tensors, *hf_name(layer_path(path, i)), dtype)
                        for i in range(leaf.shape[0])
                    ]
                )
            else:
                read = _reader(handles, tensors, *hf_name(path), dtype)
            params[path] = jax.make_array_from_callback(leaf.shape, shardings[path], read)
    return traverse_util.unflatten_dict(params)


# Files that hold a tokenizer's vocabulary, any one of which AutoTokenizer can load.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json + merges.txt")


def has_tokenizer(path: str) -> bool:
    """Whether the directory holds one of `TOKENIZER_FILES`."""
    return any(
        all(os.path.isfile(os.path.join(path, f)) for f in files.split(" + ")) for files in TOKENIZER_FILES
    )


def load_tokenizer(path: str) -> transformers.PreTrainedTokenizerBase:
    """The tokenizer of a local directory, chat template included; never runs remote code.

    A tokenizer saved as a plain fast tokenizer (`PreTrainedTokenizerFast`, transformers 5's
    `TokenizersBackend`) is loaded as one: `AutoTokenizer` would otherwise pick the class from
    config.json's model type (Qwen2Tokenizer) and silently drop a custom tokenizer's spaces.
    """
    if not os.path.isdir(path):
        raise ModelFolderError(path, "is not a directory: the tokenizer loads from a local folder")
    if not has_tokenizer(path):
        raise ModelFolderError(path, f"holds no tokenizer (one of {', '.join(TOKENIZER_FILES)})")
    config_path = os.path.join(path, "tokenizer_config.json")
    declared = None
    if os.path.isfile(config_path):
        tokenizer_config = _json_file(config_path, "restore the tokenizer's files")
        declared = tokenizer_config.get("tokenizer_class") if isinstance(tokenizer_config, dict) else None
    try:
        if declared in ("PreTrainedTokenizerFast", "TokenizersBackend"):
            return transformers.PreTrainedTokenizerFast.from_pretrained(path)
        return transformers.AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    except Exception as e:  # noqa: BLE001 - whatever a broken file makes transformers raise
        raise ModelFolderError(
            path,
            f"the tokenizer does not load ({type(e).__name__}: "
            f"{str(e)[:200]}); restore the tokenizer's files",
        ) from None

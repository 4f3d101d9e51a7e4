"""Hugging Face checkpoints in: safetensors -> sharded params, the tokenizer.

A model folder is untrusted input, checked before any weight is read, and every failure is a
one-line `ModelFolderError` naming the file and the key or tensor:
  1. config.json (`hf_model_config.config_from_hf`);
  2. the safetensors headers (`safetensors_header`), sized against their files; a sharded
     index's shards present and holding what it maps to them;
  3. strict loading (`check_tensors`): the layers are `num_hidden_layers`, every tensor feeds a
     parameter of its shape (else the config.json keys behind it are named) and a float dtype, or
     is on the short list of tensors known to be unused (`_UNUSED_TENSORS`), and no parameter
     lacks one;
  4. the tokenizer (`load_tokenizer`, `hf_model_config.check_vocab`): present, and no larger than
     `vocab_size`.
`check_model_folder` runs 1-3 without reading a weight; `load_params` runs 2-3 before it reads.

Weights are read from safetensors only (never pickle) and straight into their shards: each process
reads just the slices that its own devices hold (`jax.make_array_from_callback` over memory-mapped
safetensors slices), so the full model never sits unsharded on one host. Saving (`hf_save`) writes
the Hugging Face layout (sharded files plus `model.safetensors.index.json`) that transformers and
vLLM load.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
from collections.abc import Mapping

import jax
import numpy as np
import transformers
from flax import traverse_util
from safetensors import SafetensorError, safe_open

from dapo_jax import hf_model_config, sharding
from dapo_jax.errors import ModelFolderError
from dapo_jax.model import ModelConfig, Transformer
from dapo_jax.safetensors_header import REDO, TensorInfo, read_safetensors_header

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_WEIGHT_DTYPES = ("F64", "F32", "F16", "BF16")


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
    weight_map = hf_model_config.json_file(index, REDO)
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
    hf = hf_model_config.read_hf_config(model_dir)
    config = hf_model_config.config_from_hf(hf, source=os.path.join(model_dir, "config.json"), **numerics)
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
        tokenizer_config = hf_model_config.json_file(config_path, "restore the tokenizer's files")
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

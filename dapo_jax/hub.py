"""Hugging Face Hub inputs: a config's model and data paths may be Hub ids, resolved to local
folders through `huggingface_hub`'s cache before anything else reads them.

  model.path, model.tokenizer_path, reference.path: a local folder, or a model id
      ("Qwen/Qwen2.5-7B"); `snapshot_download` fetches only `MODEL_FILES` (safetensors weights,
      config.json, tokenizer files: never pickled weights or code) into the cache, or finds them
      there;
  data.train_files, data.eval_files: a local file, or a dataset id with an optional split
      ("BytedTsinghua-SIA/DAPO-Math-17k", "owner/name:test"): its `DATA_FILES` (parquet / jsonl)
      are fetched the same way and read by `data.load_prompts` (parquet through
      `datasets.load_dataset`) as local files.

`HF_HUB_OFFLINE=1` (and `HF_HUB_CACHE` / `HF_HOME`) are honoured by `huggingface_hub`: offline, an
id resolves from the cache alone, and one that is not there is a one-line ConfigError naming it.
The model folder is then checked as any local one (`hf_io.check_model_folder`); nothing runs
remote code.
"""

from __future__ import annotations

import copy
import fnmatch
import os
import re

import huggingface_hub
import ml_collections
from huggingface_hub import constants

from dapo_jax.errors import ConfigError

MODEL_FILES = (
    "*.safetensors",
    "model.safetensors.index.json",
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
)
DATA_FILES = ("*.parquet", "*.jsonl")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_DATA_SUFFIXES = (".parquet", ".jsonl", ".json")


def is_hub_id(path: str, data: bool = False) -> bool:
    """Whether `path` names a Hub repo ("owner/name", ":split" for data) rather than a local
    path: it does not exist here, has the shape of an id and, for data, no file suffix."""
    name = path.split(":")[0] if data else path
    return (
        bool(path)
        and not os.path.exists(path)
        and bool(_HUB_ID.match(name))
        and not (data and name.endswith(_DATA_SUFFIXES))
    )


def _snapshot(repo_id: str, repo_type: str, patterns, key: str) -> str:
    try:
        return huggingface_hub.snapshot_download(repo_id, repo_type=repo_type, allow_patterns=list(patterns))
    except (OSError, ValueError) as e:  # not in the cache offline, unknown, an invalid id
        where = "while HF_HUB_OFFLINE=1" if constants.HF_HUB_OFFLINE else "nor on the Hub"
        reason = " ".join(str(e).split())[:200]
        raise ConfigError(
            f"{key} {repo_id!r} is not a local path, and as a Hub {repo_type} id "
            f"it is not in the cache {constants.HF_HUB_CACHE} {where} ({reason}); "
            "download it once online or give a local path"
        ) from None


def resolve_model(path: str, key: str = "model.path") -> str:
    """A local model folder for `path`: itself, or the cached snapshot of a Hub model id."""
    if not is_hub_id(path):
        return path
    return _snapshot(path, "model", MODEL_FILES, key)


def resolve_data(spec: str, key: str = "data.train_files") -> list[str]:
    """Local data files for `spec`: itself, or the parquet / jsonl files of a Hub dataset's
    cached snapshot, those of `:split` only when one is given (a split matches a file whose
    path within the repo contains it)."""
    if not is_hub_id(spec, data=True):
        return [spec]
    repo_id, _, split = spec.partition(":")
    folder = _snapshot(repo_id, "dataset", DATA_FILES, key)
    files = sorted(
        os.path.join(root, f)
        for root, _, names in os.walk(folder)
        for f in names
        if any(fnmatch.fnmatch(f, p) for p in DATA_FILES)
    )
    chosen = [f for f in files if split in os.path.relpath(f, folder)] if split else files
    if not chosen:
        listed = [os.path.relpath(f, folder) for f in files]
        raise ConfigError(
            f"{key} {spec!r}: the dataset holds no parquet/jsonl file"
            + (f" of split {split!r}; its files: {listed}" if split else "")
        )
    return chosen


def resolve_config(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """A copy of `c` whose model, tokenizer, reference and data paths are local (module doc)."""
    c = copy.deepcopy(c)  # keeps each key's schema (config_schema.Field)
    c.model.path = resolve_model(c.model.path, "model.path")
    if c.model.tokenizer_path:
        c.model.tokenizer_path = resolve_model(c.model.tokenizer_path, "model.tokenizer_path")
    if c.reference.path:
        c.reference.path = resolve_model(c.reference.path, "reference.path")
    for key in ("train_files", "eval_files"):
        c.data[key] = tuple(f for spec in c.data[key] for f in resolve_data(spec, f"data.{key}"))
    return c

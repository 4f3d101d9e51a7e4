"""Parameters to a Hugging Face model folder (config.json + safetensors shards + index), written
by every process of a run at once, straight into the folder (local or gs://).

The shard plan (which tensor goes in which file) is computed from the parameters' shapes and the
export dtype alone, so that every process computes the same: tensors by name, packed in order
into files of at most `max_shard_bytes` (HF's own layout: model-0000i-of-0000n.safetensors, or
model.safetensors when one file holds all). With n processes, process p writes the files i with
i % n == p (when they all see the folder; where each sees a folder of its own disk, process 0
writes them all): it gathers each of their tensors (every process joins each gather, one tensor at a
time; a scanned model's stacked leaves one layer at a time) and holds at most one file's tensors,
never the whole model. After a barrier, process 0 writes the index and config.json, so that a
folder with config.json is complete. The bytes are those of one process's export: the same plan,
the same tensors and safetensors' own serializer.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from typing import NamedTuple

import jax
import numpy as np
from flax import traverse_util
from jax.experimental import multihost_utils
from safetensors.numpy import save, save_file

from dapo_jax import hf_io, hosts, paths, sharding


class Tensor(NamedTuple):
    """One tensor of the folder: its HF name, the parameter leaf and layer it comes from (layer
    None for an unstacked leaf), whether it is transposed, and its bytes in the export dtype."""

    name: str
    path: tuple
    layer: int | None
    transposed: bool
    nbytes: int


def plan(params, dtype: str | None, max_shard_bytes: int) -> list[tuple[str, list[Tensor]]]:
    """The folder's files in order, each (file name, its tensors), from shapes and dtypes only."""
    tensors = []
    for path, x in traverse_util.flatten_dict(params).items():
        itemsize = np.dtype(jax.numpy.dtype(dtype) if dtype else x.dtype).itemsize
        layers = range(x.shape[0]) if path[0] == "layers" else [None]
        per_layer = x.shape[1:] if path[0] == "layers" else x.shape
        for i in layers:
            name, transposed = hf_io.hf_name(hf_io.layer_path(path, i) if i is not None else path)
            tensors.append(Tensor(name, path, i, transposed, int(np.prod(per_layer)) * itemsize))
    files, current, size = [], [], 0
    for t in sorted(tensors):
        if current and size + t.nbytes > max_shard_bytes:
            files.append(current)
            current, size = [], 0
        current.append(t)
        size += t.nbytes
    files.append(current)
    if len(files) == 1:
        return [(hf_io.SINGLE_FILE, files[0])]
    return [(f"model-{i + 1:05d}-of-{len(files):05d}.safetensors", f) for i, f in enumerate(files)]


_layer = jax.jit(lambda x, i: x[i])  # one layer of a stacked leaf, still sharded


def _gather(x, t: Tensor, np_dtype) -> np.ndarray:
    """Tensor `t` of leaf `x` on this host: gathered, transposed, cast."""
    host = sharding.to_host(_layer(x, t.layer) if t.layer is not None else x)
    host = host.T if t.transposed else host
    return np.ascontiguousarray(host.astype(np_dtype) if np_dtype else host)


def save_params(
    params, hf_config: Mapping, out_dir: str, *, dtype: str | None = None, max_shard_bytes: int = 5 * 2**30
) -> None:
    """Write `params` into `out_dir` (a local folder or a URL) as a Hugging Face checkpoint:
    every process calls it and writes its share of the shard files (see the module docstring)."""
    flat = traverse_util.flatten_dict(params)
    np_dtype = np.dtype(jax.numpy.dtype(dtype)) if dtype else None
    files = plan(params, dtype, max_shard_bytes)
    me, n = _process()
    out = paths.run_path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    writers = n if n > 1 and _shared(out, me, n) else 1
    for i, (file, tensors) in enumerate(files):
        mine = i % writers == me
        shard = {}
        for t in tensors:
            host = _gather(flat[t.path], t, np_dtype)
            if mine:
                shard[t.name] = host
        if mine:
            _write(shard, out / file)
    if n > 1:
        multihost_utils.sync_global_devices("dapo_jax.hf_save written")
    if me != 0:
        return
    if len(files) > 1:
        weight_map = {t.name: file for file, tensors in files for t in tensors}
        total = sum(t.nbytes for _, tensors in files for t in tensors)
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / hf_io.INDEX_FILE).write_text(json.dumps(index, indent=2))
    config = dict(hf_config)
    first = next(iter(flat.values()))
    config["dtype"] = str(np_dtype or np.dtype(first.dtype))
    config.pop("torch_dtype", None)
    (out / "config.json").write_text(json.dumps(config, indent=2))


def _shared(out, me: int, n: int) -> bool:
    """Whether every process sees the same folder `out` (gs://, or a shared file system), not a
    folder of its own disk: each writes a marker, and each looks for everyone's; the same answer
    on every process. Where it is not shared, process 0 writes every file."""
    marker = out / f".dapo-export-process-{me}"
    marker.write_text("")
    multihost_utils.sync_global_devices("dapo_jax.hf_save markers written")
    sees_all = all((out / f".dapo-export-process-{p}").exists() for p in range(n))
    shared = all(hosts.allgather_json(sees_all))
    multihost_utils.sync_global_devices("dapo_jax.hf_save markers read")
    marker.unlink()
    return shared


def _process() -> tuple[int, int]:
    """(this process's index, the process count)."""
    return jax.process_index(), jax.process_count()


def _write(shard: dict, path) -> None:
    """One safetensors file, written in place locally, or uploaded whole to a URL."""
    if paths.is_url(path):
        path.write_bytes(save(shard, metadata={"format": "pt"}))
    else:
        save_file(shard, str(path), metadata={"format": "pt"})


def save_model(
    params, hf_config: dict, tokenizer, model_dir: str, out: str, dtype: str, max_shard_bytes: int
) -> str:
    """`params` as a Hugging Face model directory `out` (local or a URL): every process writes
    its own safetensors shards (`save_params`); process 0 then adds the tokenizer and the base
    model's (`model_dir`) generation_config.json, and checks the folder as a load would."""
    save_params(params, hf_config, out, dtype=dtype, max_shard_bytes=max_shard_bytes)
    if jax.process_index() != 0:
        return out
    gen = os.path.join(model_dir, "generation_config.json")
    if not paths.is_url(out):
        tokenizer.save_pretrained(out)
        if os.path.isfile(gen):
            shutil.copy(gen, out)
        hf_io.check_model_folder(out)  # what a load of the export checks, before anyone loads it
        return out
    with tempfile.TemporaryDirectory(prefix="dapo-export-") as local:  # the small files only
        tokenizer.save_pretrained(local)
        if os.path.isfile(gen):
            shutil.copy(gen, local)
        paths.upload_tree(local, out)
    return out

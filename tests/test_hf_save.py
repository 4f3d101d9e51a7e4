"""The Hugging Face folder written by several processes, each its own shard files, equals the
one written by one process, byte for byte (the other processes run here one after the other;
tests/test_pod.py runs four real ones)."""

import json
import os

import numpy as np
from safetensors.numpy import load_file

from dapo_jax import hf_io, hf_model_config, hf_save, model, sharding


def _params(model_dir):
    m = model.Transformer(
        hf_model_config.config_from_hf(hf_model_config.read_hf_config(model_dir), dtype="float32")
    )
    return hf_io.load_params(model_dir, m, sharding.make_mesh({"fsdp": -1}))


def test_three_processes_write_the_folder_of_one(qwen2_dir, tmp_path, monkeypatch):
    params, hf_config = _params(qwen2_dir), hf_model_config.read_hf_config(qwen2_dir)
    one, three = tmp_path / "one", tmp_path / "three"
    hf_save.save_params(params, hf_config, str(one), dtype="bfloat16", max_shard_bytes=40_000)
    monkeypatch.setattr(hf_save.multihost_utils, "sync_global_devices", lambda name: None)
    monkeypatch.setattr(hf_save, "_shared", lambda out, me, n: True)  # one folder, as on gs://
    written = {}
    for p in range(3):
        before = set(os.listdir(three)) if three.exists() else set()
        monkeypatch.setattr(hf_save, "_process", lambda p=p: (p, 3))
        hf_save.save_params(params, hf_config, str(three), dtype="bfloat16", max_shard_bytes=40_000)
        written[p] = sorted(set(os.listdir(three)) - before)
    files = sorted(os.listdir(one))
    assert files == sorted(os.listdir(three))
    for name in files:
        assert (one / name).read_bytes() == (three / name).read_bytes(), name
    shards = [f for f in files if f.endswith(".safetensors")]
    assert len(shards) >= 4
    for p in range(3):  # shard i by process i % 3; the index and config.json by process 0, last
        mine = [f for i, f in enumerate(shards) if i % 3 == p]
        assert written[p] == sorted(mine + (["config.json", hf_io.INDEX_FILE] if p == 0 else []))


def test_the_folder_holds_every_parameter_under_its_hf_name(qwen2_dir, tmp_path):
    """An independent reading: every tensor of the source folder, in the index and equal."""
    params, hf_config = _params(qwen2_dir), hf_model_config.read_hf_config(qwen2_dir)
    hf_save.save_params(params, hf_config, str(tmp_path), max_shard_bytes=40_000)
    index = json.loads((tmp_path / hf_io.INDEX_FILE).read_text())
    source = load_file(os.path.join(qwen2_dir, "model.safetensors"))
    assert sorted(index["weight_map"]) == sorted(source)
    loaded = {}
    for file in set(index["weight_map"].values()):
        loaded.update(load_file(str(tmp_path / file)))
    for name, tensor in source.items():
        np.testing.assert_array_equal(loaded[name], tensor, err_msg=name)
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in source.values())


def test_processes_that_each_see_a_folder_of_their_own_leave_the_writing_to_process_0(tmp_path, monkeypatch):
    """Process 0 of two: it sees process 1's marker only where the folder is shared."""
    monkeypatch.setattr(hf_save.multihost_utils, "sync_global_devices", lambda name: None)
    monkeypatch.setattr(hf_save.hosts, "allgather_json", lambda mine: [mine, mine])
    out = hf_save.paths.run_path(str(tmp_path))
    assert not hf_save._shared(out, 0, 2)  # process 1 wrote its marker on its own disk
    (tmp_path / ".dapo-export-process-1").write_text("")  # ... or here: one folder
    assert hf_save._shared(out, 0, 2)
    assert sorted(os.listdir(tmp_path)) == [".dapo-export-process-1"]  # its own marker removed

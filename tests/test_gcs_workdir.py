"""A `gs://` workdir stays a URL end to end: a tiny run on a fake GCS (fsspec's in-memory
filesystem behind etils.epath) writes its metrics, TensorBoard events, plots and export there,
hands the URL to the checkpointer, resumes by reading its metrics back, and creates no local
folder named after the URL."""

import json
import os
import time

import pytest
from etils.epath import backend
from fsspec.implementations.memory import MemoryFileSystem

from configs import dapo
from dapo_jax import checkpoint, cli, metrics, paths, plot, train

from conftest import small

URL = "gs://bucket/run1"


@pytest.fixture
def fake_gcs(monkeypatch):
    """gs:// paths of epath go to a fresh in-memory filesystem; returns its {path: bytes}."""
    mem = MemoryFileSystem()
    monkeypatch.setattr(MemoryFileSystem, "store", {})
    monkeypatch.setattr(MemoryFileSystem, "pseudo_dirs", [""])
    real = backend.fsspec_backend.fs
    monkeypatch.setattr(
        backend.fsspec_backend, "fs", lambda path: mem if os.fspath(path).startswith("gs://") else real(path)
    )
    return MemoryFileSystem.store


def _no_local_url_folder():
    return not os.path.exists("gs:") and not os.path.exists(os.path.join("bucket", "run1"))


def test_metrics_tensorboard_and_plots_go_through_the_path_layer(fake_gcs):
    w = metrics.MetricsWriter(URL)
    for step in (1, 2, 3):
        w.write(step, {"before_filter/acc_mean": step / 10})
    w.close()
    time.sleep(1.1)  # events files are named by the second they are opened in
    resumed = metrics.MetricsWriter(URL, resume_step=1)  # checkpoint at 1, killed at 3
    resumed.write(2, {"before_filter/acc_mean": 0.5})
    resumed.close()
    records = metrics.read_jsonl(f"{URL}/metrics.jsonl")
    assert [(r["step"], r["before_filter/acc_mean"]) for r in records] == [(1, 0.1), (2, 0.5)]
    written = plot.plot_runs([URL], f"{URL}/plots")
    assert written[-1] == f"{URL}/plots/curves.png"
    for path in written:
        assert fake_gcs[path].getvalue()[:8] == b"\x89PNG\r\n\x1a\n"
    events = [k for k in fake_gcs if k.startswith(f"{URL}/tensorboard/events.out.tfevents")]
    assert len(events) == 2 and all(b"before_filter/acc_mean" in fake_gcs[k].getvalue() for k in events)
    assert _no_local_url_folder()


def test_an_unsupported_url_is_refused_not_made_local():
    with pytest.raises(ValueError, match="memory:// is not supported"):
        paths.run_path("memory://bucket/run1")


def test_upload_tree_copies_a_local_folder(fake_gcs, tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.json").write_text("{}")
    (tmp_path / "sub" / "b.bin").write_bytes(b"\0" * 10)
    paths.upload_tree(str(tmp_path), f"{URL}/export")
    assert fake_gcs[f"{URL}/export/a.json"].getvalue() == b"{}"
    assert fake_gcs[f"{URL}/export/sub/b.bin"].getvalue() == b"\0" * 10


@pytest.mark.slow
def test_a_tiny_run_in_a_gs_workdir_writes_and_reads_back_through_the_path_layer(
    fake_gcs, tmp_path, monkeypatch
):
    # Orbax writes arrays with tensorstore, whose gcs driver no fake reaches: the checkpointer
    # is handed the URL and keeps its checkpoints in a local folder instead.
    given = []

    class LocalCheckpointer(checkpoint.Checkpointer):
        def __init__(self, workdir, **kwargs):
            given.append(workdir)
            super().__init__(str(tmp_path / "checkpoint-store"), **kwargs)

    monkeypatch.setattr(train.checkpoint, "Checkpointer", LocalCheckpointer)
    config = small(dapo.get_config("tiny"), train__steps=2)
    train.train(config, URL)
    config.train.steps = 3
    train.train(config, URL)  # resumes from step 2, rereads the metrics file on the fake GCS
    cli.report(URL, {"export_dir": f"{URL}/export"}, steps=3)

    assert given == [URL, URL]
    records = [json.loads(line) for line in fake_gcs[f"{URL}/metrics.jsonl"].getvalue().decode().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        assert f"{URL}/export/{name}" in fake_gcs, name
    assert f"{URL}/plots/curves.png" in fake_gcs
    assert sum(k.startswith(f"{URL}/tensorboard/") for k in fake_gcs) == 2  # one per run
    assert LocalCheckpointer("x").all_steps() == [1, 2, 3]
    assert _no_local_url_folder()

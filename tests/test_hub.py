"""Hub inputs through a local Hugging Face cache built here (HF_HUB_OFFLINE=1, no network): a
model id and a dataset id resolve and load, an unknown id is one line naming it, and
prepare_data writes the deduplicated parquet files from a Hub id or a local copy."""

import os
import shutil
import subprocess
import sys

import huggingface_hub
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from configs import dapo
from dapo_jax import config_checks, data, hf_io, hub
from dapo_jax.errors import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _hub_repo(cache, repo_type, repo_id, files):
    """The cache layout huggingface_hub writes: <type>s--owner--name/{refs/main, snapshots/<sha>}
    with `files` ({path in repo: local file to copy})."""
    root = cache / f"{repo_type}s--{repo_id.replace('/', '--')}"
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(COMMIT)
    for name, source in files.items():
        target = root / "snapshots" / COMMIT / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(source, target)
    return root / "snapshots" / COMMIT


@pytest.fixture
def cache(tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    tiny = os.path.join(ROOT, "assets", "tiny-qwen2")
    _hub_repo(cache, "model", "tiny-org/tiny-qwen2", {f: os.path.join(tiny, f) for f in os.listdir(tiny)})
    synthetic = os.path.join(ROOT, "data", "synthetic")
    _hub_repo(
        cache,
        "dataset",
        "tiny-org/synthetic",
        {
            "data/train.parquet": os.path.join(synthetic, "train.parquet"),
            "data/test.parquet": os.path.join(synthetic, "test.parquet"),
            "README.md": os.path.join(ROOT, "README.md"),
        },
    )
    return cache


def test_model_and_dataset_ids_resolve_through_the_cache(cache):
    c = dapo.get_config("tiny")
    c.model.path = "tiny-org/tiny-qwen2"
    c.data.train_files = ("tiny-org/synthetic:train",)
    c.data.eval_files = ("tiny-org/synthetic",)
    resolved = hub.resolve_config(c)
    snapshot = cache / "models--tiny-org--tiny-qwen2" / "snapshots" / COMMIT
    assert resolved.model.path == str(snapshot)
    data_dir = cache / "datasets--tiny-org--synthetic" / "snapshots" / COMMIT / "data"
    assert resolved.data.train_files == (str(data_dir / "train.parquet"),)
    assert resolved.data.eval_files == (str(data_dir / "test.parquet"), str(data_dir / "train.parquet"))
    assert c.model.path == "tiny-org/tiny-qwen2"  # the caller's config is left as it was
    config_checks.check_config(resolved)
    hf_io.check_model_folder(resolved.model.path)
    tokenizer = hf_io.load_tokenizer(resolved.model.path)
    loaded = data.load_prompts(resolved.data.train_files[0], tokenizer, 48, template="{problem}")
    assert loaded.n_rows == pq.ParquetFile(data_dir / "train.parquet").metadata.num_rows == 4000


def test_an_unknown_hub_id_offline_is_one_line_naming_it(cache):
    with pytest.raises(ConfigError) as e:
        hub.resolve_model("nobody/no-such-model")
    message = str(e.value)
    assert (
        message.startswith(
            "model.path 'nobody/no-such-model' is not a local path, and as a "
            "Hub model id it is not in the cache"
        )
        and "HF_HUB_OFFLINE=1" in message
    )
    assert "\n" not in message
    with pytest.raises(ConfigError, match="split 'validation'; its files: "):
        hub.resolve_data("tiny-org/synthetic:validation")
    assert hub.resolve_data("data/missing.parquet") == ["data/missing.parquet"]  # a local path


@pytest.mark.slow
def test_the_training_command_names_an_unknown_hub_id(cache, tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "dapo_jax.train",
            "--config=configs/dapo.py:tiny",
            f"--workdir={tmp_path / 'run'}",
            "--config.model.path=nobody/nothing",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    errors = [l for l in out.stderr.splitlines() if l.startswith("error")]
    assert out.returncode == 2 and len(errors) == 1
    assert errors[0].startswith("error: model.path 'nobody/nothing' is not a local path")


def _row(problem, answer, index):
    return {
        "data_source": "math_dapo",
        "prompt": [{"role": "user", "content": problem}],
        "ability": "MATH",
        "reward_model": {"ground_truth": answer, "style": "rule"},
        "extra_info": {"index": str(index)},
    }


@pytest.mark.slow
def test_prepare_data_deduplicates_from_a_hub_id_or_a_local_copy(cache, tmp_path):
    rows = [
        _row("1+1?", "2", 0),
        _row("2+2?", "4", 1),
        _row("1+1?", "2", 2),
        _row("3+3?", "6", 3),
        _row("1+1?", "2", 4),
        _row("2+2?", "4", 5),
        {**_row("x", "1", 6), "reward_model": {"ground_truth": "", "style": "rule"}},
    ]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "dapo.parquet")
    _hub_repo(
        cache, "dataset", "tiny-org/dapo-math", {"data/dapo-math-17k.parquet": tmp_path / "dapo.parquet"}
    )
    aime = [_row(f"AIME problem {i % 2}", str(i % 2), i) for i in range(6)]  # 2 problems x 3
    pq.write_table(pa.Table.from_pylist(aime), tmp_path / "aime.parquet")
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "dapo_jax.prepare_data",
            f"--out_dir={tmp_path / 'out'}",
            "--dapo_math=tiny-org/dapo-math",
            f"--aime={tmp_path / 'aime.parquet'}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert lines[0].endswith(
        "dapo-math-17k.parquet: 3 problems from 7 rows of tiny-org/dapo-math "
        "(3 duplicates and 1 malformed rows dropped)"
    )
    assert "aime-2024.parquet: 2 problems from 6 rows" in lines[1] and "(4 duplicates and 0" in lines[1]
    written = pq.read_table(tmp_path / "out" / "dapo-math-17k.parquet").to_pylist()
    assert [r["extra_info"]["index"] for r in written] == ["0", "1", "3"]  # first of each kept
    assert written[0]["reward_model"] == {"ground_truth": "2", "style": "rule"}
    data.check_data_file(str(tmp_path / "out" / "aime-2024.parquet"))

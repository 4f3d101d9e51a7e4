"""The persistent compilation cache: a relaunch of the tiny run in a fresh process compiles none of
the programs the first process compiled, reading them from `<workdir>/compilation_cache`."""

import json
import os
import subprocess
import sys

import pytest

from conftest import small_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The trainer's command line, with every compile request that goes through the persistent cache
# logged as (hit or miss, module name, cache key) into the JSON file named by argv[1].
_LOGGED_TRAIN = """
import atexit, json, logging, sys
from dapo_jax import cli
compiles = []
class Record(logging.Handler):
    def emit(self, r):
        if r.msg.startswith(("Persistent compilation cache hit", "PERSISTENT COMPILATION CACHE MISS")):
            compiles.append(("hit" if "hit" in r.msg else "miss", r.args[0], r.args[1]))
log = logging.getLogger("jax._src.compiler")
log.setLevel(logging.DEBUG)
log.propagate = False
log.addHandler(Record())
out = sys.argv.pop(1)
atexit.register(lambda: json.dump(compiles, open(out, "w")))
cli.run(cli.train_main)
"""


def _train(tmp_path, name: str, steps: int) -> list:
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}  # the default
    log = tmp_path / f"{name}.json"
    cmd = [
        sys.executable,
        "-c",
        _LOGGED_TRAIN,
        str(log),
        "--config=configs/dapo.py:tiny",
        f"--workdir={tmp_path / 'run'}",
        *small_flags(train__steps=steps),
    ]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(log.read_text())


@pytest.mark.slow
def test_a_relaunch_compiles_nothing_the_first_run_compiled(tmp_path):
    first = _train(tmp_path, "first", steps=1)
    again = _train(tmp_path, "again", steps=2)  # resumes from step 1's checkpoint, runs step 2
    assert (tmp_path / "run" / "compilation_cache").is_dir()
    compiled_first = {(name, key) for kind, name, key in first if kind == "miss"}
    modules_first = {name for name, _ in compiled_first}
    hits = [name for kind, name, _ in again if kind == "hit"]
    misses = [name for kind, name, _ in again if kind == "miss"]
    print(f"first run: {len(compiled_first)} compiled; relaunch: {len(hits)} read, {len(misses)} compiled")
    assert len(compiled_first) > 5 and len(hits) > 5
    # the relaunch's step reads the first run's update, log-prob pass and rollout (`per_shard`:
    # the decode loop of each device of the tiny run's data-only mesh)
    for module in ("jit__train_step", "jit_compute_logprobs", "jit_per_shard"):
        assert module in modules_first and module in hits
    assert not set(misses) & modules_first, sorted(set(misses) & modules_first)

"""Two JAX processes (jax.distributed over gloo, two CPU devices each) on a mesh that spans both:
their gathered rollouts equal one process's on one device, and their training run, stopped by
the death of one process (SIGKILL: the other stops within the heartbeat timeout, naming it) and
resumed from its checkpoint, equals one process's uninterrupted run on the same mesh. (A SIGTERM
to one of four processes: tests/test_pod.py; a run stopped by its end resumes through the same
restore: test_gcs_workdir.py, one process.)"""

import os
import re
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from dapo_jax import decoding, hf_io, hf_model_config, metrics, model, sampler, sharding

pytestmark = pytest.mark.slow  # processes that start, compile and talk over gloo

PROCESSES, DEVICES_PER_PROCESS = 2, 2
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _config():
    return decoding.SamplingConfig(
        max_new_tokens=12,
        eos_ids=tuple(range(2, 14)),
        pad_id=0,
        prompt_buckets=(8,),
        temperature=0.8,
        top_k=40,
    )


def _prompts():
    rng = np.random.default_rng(1)
    tokens = rng.integers(1, 96, size=(4, 8)).astype(np.int32)
    mask = np.arange(8)[None] >= np.array([[0], [3], [1], [5]])
    return np.where(mask, tokens, 0), mask


def _rollouts(model_dir: str, mesh) -> decoding.Samples:
    m = model.Transformer(
        hf_model_config.config_from_hf(hf_model_config.read_hf_config(model_dir), dtype="float32")
    )
    params = hf_io.load_params(model_dir, m, mesh)
    out = sampler.Sampler(m, _config(), mesh).generate(params, *_prompts(), 2, jax.random.key(7))
    return jax.tree.map(sharding.to_host, out)


def _worker(process_id: int, port: int, model_dir: str, out_path: str) -> None:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"localhost:{port}", PROCESSES, process_id)
    assert jax.device_count() == PROCESSES * DEVICES_PER_PROCESS
    out = _rollouts(model_dir, sharding.make_mesh({"data": 2, "fsdp": 2}))
    if process_id == 0:
        np.savez(out_path, **out._asdict())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _env(devices: int) -> dict:
    """The processes' environment: `devices` CPU devices each and no compilation cache shared
    with the test session (conftest.py): a process that loads its programs from the cache can
    reach the first collective long before one that compiles them, past gloo's 30 s rendezvous."""
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    path = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)  # this checkout's dapo_jax
    return {**env, "PYTHONPATH": path, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}


def _run_together(commands: list[list[str]], devices: int, timeout: int = 600) -> None:
    """Run the commands at once as processes with `devices` CPU devices each; all must succeed."""
    env = _env(devices)
    procs = [
        subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for cmd in commands
    ]
    logs = [p.communicate(timeout=timeout)[0] for p in procs]
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-3000:]


def test_two_processes_sample_as_one(qwen2_dir, tmp_path):
    out_path = str(tmp_path / "rollouts.npz")
    port = _free_port()
    _run_together(
        [[sys.executable, __file__, str(i), str(port), qwen2_dir, out_path] for i in range(PROCESSES)],
        DEVICES_PER_PROCESS,
    )

    got = np.load(out_path)
    ref = _rollouts(qwen2_dir, sharding.make_mesh({"data": 1}, devices=jax.devices()[:1]))
    for key in ("tokens_BxN", "mask_BxN", "length_B", "truncated_B"):
        np.testing.assert_array_equal(got[key], getattr(ref, key), err_msg=key)
    np.testing.assert_allclose(got["logp_BxN"], ref.logp_BxN, atol=1e-5)
    assert got["tokens_BxN"].shape == (8, 12) and 0 < got["mask_BxN"].sum() < got["mask_BxN"].size


def _flags():
    from conftest import small_flags  # here: it sets the __main__ workers' devices

    return [
        "--config=configs/dapo.py:tiny",
        "--config.mesh.data=2",
        "--config.mesh.fsdp=2",
        *small_flags(filter__carry_over=True),
    ]


def _train(workdir, steps, *extra):
    return [
        sys.executable,
        "-m",
        "dapo_jax.train",
        *_flags(),
        f"--workdir={workdir}",
        f"--config.train.steps={steps}",
        *extra,
    ]


def _multihost(port, i, *extra):
    return [
        "--multihost",
        f"--coordinator=localhost:{port}",
        f"--num_processes={PROCESSES}",
        f"--process_id={i}",
        *extra,
    ]


def _maths(workdir):
    from conftest import WALL_CLOCK

    records = metrics.read_jsonl(os.path.join(workdir, metrics.JSONL))
    assert [r["step"] for r in records] == [1, 2, 3]  # one writer: no step missing or repeated
    return {r["step"]: {k: v for k, v in r.items() if not k.startswith(WALL_CLOCK)} for r in records}


def _assert_matches(got, expected):
    for step in expected:  # gloo's all-reduces may sum in another order than one process's
        assert got[step].keys() == expected[step].keys()
        for key, value in expected[step].items():
            assert got[step][key] == pytest.approx(value, rel=1e-4, abs=1e-5), (step, key)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The metrics of one process's uninterrupted 3-step run on the same 4-device mesh."""
    workdir = str(tmp_path_factory.mktemp("reference"))
    _run_together([_train(workdir, 3)], 4)
    return _maths(workdir)


def _start(commands, tmp_path, name):
    """Start the commands with two CPU devices each, output in tmp_path/name-i.log."""
    env = _env(DEVICES_PER_PROCESS)
    logs = [open(tmp_path / f"{name}-{i}.log", "w") for i in range(len(commands))]
    return [
        subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        for cmd, log in zip(commands, logs)
    ]


def _wait_until(condition, procs, what, timeout=600):
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, f"no {what} within {timeout} s"
        assert all(p.poll() is None for p in procs), f"a process ended before {what}"
        time.sleep(0.2)


def _has_step(workdir, step):
    path = os.path.join(workdir, metrics.JSONL)
    return os.path.exists(path) and any(r["step"] >= step for r in metrics.read_jsonl(path))


def test_a_dead_process_stops_the_other_which_names_it(reference, tmp_path):
    """Separate working folders (as on separate VMs), one shared checkpoint folder: process 1
    is killed (SIGKILL) after the first checkpoint is complete; process 0 exits non-zero within
    2 minutes naming process 1 (its own message, or the coordination service's "tasks are
    unhealthy ... : 1", whichever comes first); relaunched, both resume and match."""
    workdirs = [str(tmp_path / f"host{i}") for i in range(PROCESSES)]
    shared = str(tmp_path / "checkpoints")

    def commands(port):
        return [
            _train(
                workdirs[i], 3, f"--checkpoint_dir={shared}", *_multihost(port, i, "--heartbeat_timeout=10")
            )
            for i in range(PROCESSES)
        ]

    procs = _start(commands(_free_port()), tmp_path, "killed")
    _wait_until(lambda: os.path.isdir(os.path.join(shared, "1")), procs, "checkpoint 1")
    procs[1].send_signal(signal.SIGKILL)
    t0 = time.time()
    rc = procs[0].wait(timeout=120)
    elapsed = time.time() - t0
    log = (tmp_path / "killed-0.log").read_text()
    assert rc != 0 and elapsed < 120, (rc, elapsed, log[-3000:])
    named = re.search(r"process\(es\) 1 of 2 stopped sending heartbeats", log) or re.search(
        r"tasks are unhealthy \(stopped sending heartbeats\):\s*1\b", log
    )
    assert named, log[-3000:]
    print(f"process 0 exited with {rc} {elapsed:.1f} s after process 1 was killed")
    assert not os.path.exists(os.path.join(workdirs[1], metrics.JSONL))  # process 0 writes them
    _run_together(commands(_free_port()), DEVICES_PER_PROCESS)
    _assert_matches(_maths(workdirs[0]), reference)


if __name__ == "__main__":
    _worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])

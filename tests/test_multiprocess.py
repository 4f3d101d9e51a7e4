"""Two JAX processes (jax.distributed over gloo, two CPU devices each) on a mesh that spans both:
their gathered rollouts equal one process's on one device, and their training run, stopped and
resumed from its checkpoint, equals one process's uninterrupted run on the same mesh."""

import os
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest

from dapo_jax import hf_io, metrics, model, sampler, sharding

pytestmark = pytest.mark.slow  # processes that start, compile and talk over gloo

PROCESSES, DEVICES_PER_PROCESS = 2, 2
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _config():
    return sampler.SamplingConfig(max_new_tokens=12, eos_ids=tuple(range(2, 14)), pad_id=0,
                                  prompt_buckets=(8,), temperature=0.8, top_k=40)


def _prompts():
    rng = np.random.default_rng(1)
    tokens = rng.integers(1, 96, size=(4, 8)).astype(np.int32)
    mask = np.arange(8)[None] >= np.array([[0], [3], [1], [5]])
    return np.where(mask, tokens, 0), mask


def _rollouts(model_dir: str, mesh) -> dict:
    m = model.Transformer(hf_io.config_from_hf(hf_io.read_hf_config(model_dir), dtype="float32"))
    params = hf_io.load_params(model_dir, m, mesh)
    out = sampler.Sampler(m, _config(), mesh).generate(params, *_prompts(), 2, jax.random.key(7))
    return {k: sharding.to_host(v) for k, v in out.items()}


def _worker(process_id: int, port: int, model_dir: str, out_path: str) -> None:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"localhost:{port}", PROCESSES, process_id)
    assert jax.device_count() == PROCESSES * DEVICES_PER_PROCESS
    out = _rollouts(model_dir, sharding.make_mesh({"data": 2, "fsdp": 2}))
    if process_id == 0:
        np.savez(out_path, **out)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _run_together(commands: list[list[str]], devices: int, timeout: int = 600) -> None:
    """Run the commands at once as processes with `devices` CPU devices each; all must succeed."""
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
    procs = [subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for cmd in commands]
    logs = [p.communicate(timeout=timeout)[0] for p in procs]
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-3000:]


def test_two_processes_sample_as_one(qwen2_dir, tmp_path):
    out_path = str(tmp_path / "rollouts.npz")
    port = _free_port()
    _run_together([[sys.executable, __file__, str(i), str(port), qwen2_dir, out_path]
                   for i in range(PROCESSES)], DEVICES_PER_PROCESS)

    got = np.load(out_path)
    ref = _rollouts(qwen2_dir, sharding.make_mesh({"data": 1}, devices=jax.devices()[:1]))
    for key in ("tokens", "mask", "length", "truncated"):
        np.testing.assert_array_equal(got[key], ref[key], err_msg=key)
    np.testing.assert_allclose(got["logp"], ref["logp"], atol=1e-5)
    assert got["tokens"].shape == (8, 12) and 0 < got["mask"].sum() < got["mask"].size


def test_two_processes_train_and_resume_as_one(tmp_path):
    """Both processes write and restore the checkpoints, process 0 alone the metrics and
    TensorBoard events; every metric of the maths matches the one-process run's."""
    from conftest import WALL_CLOCK, small_flags  # here: it sets the __main__ workers' devices

    flags = ["--config=configs/dapo.py:tiny", "--config.mesh.data=2", "--config.mesh.fsdp=2",
             *small_flags(filter__carry_over=True)]
    train = [sys.executable, "-m", "dapo_jax.train", *flags]
    reference, multi = str(tmp_path / "reference"), str(tmp_path / "multi")
    _run_together([[*train, f"--workdir={reference}", "--config.train.steps=3"]], 4)
    for steps in (2, 3):  # the second run resumes from the first's last checkpoint
        port = _free_port()
        _run_together([[*train, f"--workdir={multi}", f"--config.train.steps={steps}",
                        "--multihost", f"--coordinator=localhost:{port}",
                        f"--num_processes={PROCESSES}", f"--process_id={i}"]
                       for i in range(PROCESSES)], DEVICES_PER_PROCESS)

    def maths(workdir):
        records = metrics.read_jsonl(os.path.join(workdir, metrics.JSONL))
        assert [r["step"] for r in records] == [1, 2, 3]  # one writer: no step missing or repeated
        return {r["step"]: {k: v for k, v in r.items() if not k.startswith(WALL_CLOCK)}
                for r in records}
    expected, got = maths(reference), maths(multi)
    assert len(os.listdir(os.path.join(multi, "tensorboard"))) == 2  # an events file per run
    for step in expected:  # gloo's all-reduces may sum in another order than one process's
        assert got[step].keys() == expected[step].keys()
        for key, value in expected[step].items():
            assert got[step][key] == pytest.approx(value, rel=1e-4, abs=1e-5), (step, key)


if __name__ == "__main__":
    _worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])

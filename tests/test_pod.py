"""A CPU "pod": four JAX processes (jax.distributed over gloo, two CPU devices each, the trainer's
mesh data 4 x fsdp 2 across all eight) on the tiny config, with a rollout mesh unlike the
trainer's (data 4 x tensor 2). A reward that disagrees on one process stops every process with
the same one-line error; a SIGTERM to one process mid-step stops all four with status 75 within
30 s, and the relaunch ends with the metrics and the exported folder (written by the four
processes, each its own safetensors shards) of one process's uninterrupted run, byte for byte.

This file is also the processes' entry point (`python tests/test_pod.py FAULT_PROCESS ARGS...`):
train's command line, with process FAULT_PROCESS's reward scores negated after they are
gathered (-1: none), as a host whose reward fn disagrees would have them."""

import os
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.slow  # four processes that start, compile and talk over gloo

PROCESSES, DEVICES_PER_PROCESS = 4, 2
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _flags(workdir, steps, *extra):
    from conftest import small_flags  # here: it sets the __main__ workers' devices

    return [
        "--config=configs/dapo.py:tiny",
        "--config.mesh.data=4",
        "--config.mesh.fsdp=2",
        "--config.rollout.tensor_parallel=2",
        *small_flags(),
        f"--config.train.steps={steps}",
        f"--workdir={workdir}",
        *extra,
    ]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _env(devices: int) -> dict:
    """`devices` CPU devices a process and no compilation cache shared with the test session
    (test_multiprocess.py says why)."""
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    return {**env, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}


def _pod(tmp_path, name, workdir, steps, *extra, fault=-1):
    """Start the four processes; their output in tmp_path/name-i.log."""
    port = _free_port()
    procs = []
    for i in range(PROCESSES):
        cmd = [
            sys.executable,
            __file__,
            str(fault),
            *_flags(workdir, steps, *extra),
            "--multihost",
            f"--coordinator=localhost:{port}",
            f"--num_processes={PROCESSES}",
            f"--process_id={i}",
            "--heartbeat_timeout=20",
        ]
        log = open(tmp_path / f"{name}-{i}.log", "w")
        procs.append(
            subprocess.Popen(
                cmd, cwd=ROOT, env=_env(DEVICES_PER_PROCESS), stdout=log, stderr=subprocess.STDOUT
            )
        )
    return procs


def _wait_all(procs, timeout):
    """Each process's (exit status, seconds from now until it ended); kills what is left at the
    timeout (status None)."""
    t0, ends = time.time(), [None] * len(procs)
    while time.time() < t0 + timeout and None in ends:
        for i, p in enumerate(procs):
            if ends[i] is None and p.poll() is not None:
                ends[i] = time.time() - t0
        time.sleep(0.1)
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
    return [(p.returncode if e is not None else None, e) for p, e in zip(procs, ends)]


def test_a_reward_that_disagrees_on_one_process_stops_all_with_one_line(tmp_path):
    """Process 2's scores of the first generation batch differ from the others': all four exit
    with status 1 and one error line naming process 2, within 60 s of the faulty scores."""
    workdir = tmp_path / "run"
    procs = _pod(tmp_path, "fault", str(workdir), 1, fault=2)
    t0 = time.time()
    ended = _wait_all(procs, 600)
    faulty = os.path.getmtime(workdir / "fault")  # written when process 2 negated its scores
    logs = [(tmp_path / f"fault-{i}.log").read_text() for i in range(PROCESSES)]
    for (rc, _), log in zip(ended, logs):
        assert rc == 1, log[-3000:]
        errors = [line for line in log.splitlines() if line.startswith("error:")]
        assert len(errors) == 1, log[-3000:]
        assert (
            "step 1, generation batch 1: the processes disagree on the rewards (processes 2 differ)"
            in errors[0]
        )
    after = [t0 + end - faulty for _, end in ended]
    print(f"the processes ended {[round(t, 1) for t in after]} s after the faulty scores")
    assert max(after) < 60


def _fault_main(argv):
    """Train, with process `argv[1]`'s gathered reward scores negated."""
    fault = int(argv[1])
    from absl import app

    from dapo_jax import hosts, train

    score_batch = hosts.SplitScorer.score_batch

    def disagreeing(self, *args, **kwargs):
        results, stats = score_batch(self, *args, **kwargs)
        if hosts.jax.process_index() == fault:
            results = [{**r, "score": -r["score"]} for r in results]
            workdir = next(a.split("=", 1)[1] for a in argv if a.startswith("--workdir="))
            open(os.path.join(workdir, "fault"), "w").close()
        return results, stats

    hosts.SplitScorer.score_batch = disagreeing
    app.run(train.main, argv=[argv[0], *argv[2:]], flags_parser=train.parse_flags)


if __name__ == "__main__":
    _fault_main(sys.argv)

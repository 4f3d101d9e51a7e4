"""A CPU "pod": four JAX processes (jax.distributed over gloo, two CPU devices each, the trainer's
mesh data 2 x fsdp 2 x tensor 2 across all eight) on the tiny config, with a rollout mesh unlike
the trainer's (data 4 x tensor 2: the trainer's fsdp folded into data). A reward that disagrees
on one process stops every process with the same one-line error; a SIGTERM to one process
mid-step stops all four with status 75 within 30 s, and the relaunch ends with the metrics of one
process's uninterrupted run; a checkpoint exported by the four processes (`export --multihost`,
each writing its own safetensors shards) equals its export by one process, byte for byte.

This file is also the processes' entry point (`python tests/test_pod.py FAULT_PROCESS ARGS...`):
train's command line, with process FAULT_PROCESS's reward scores negated after they are
gathered (-1: none), as a host whose reward fn disagrees would have them."""

import os
import signal
import subprocess
import sys
import time

import pytest

from dapo_jax import metrics

pytestmark = pytest.mark.slow  # four processes that start, compile and talk over gloo

PROCESSES, DEVICES_PER_PROCESS = 4, 2
STEPS = 2  # the SIGTERM comes after checkpoint 1, during step 2 (seconds long on 4 processes)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _flags(workdir, steps, *extra):
    from conftest import small_flags  # here: it sets the __main__ workers' devices

    return [
        "--config=configs/dapo.py:tiny",
        "--config.mesh.data=2",
        "--config.mesh.fsdp=2",
        "--config.mesh.tensor=2",
        "--config.export.max_shard_bytes=1000000",  # four shard files: one written by each process
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


@pytest.fixture(scope="module", autouse=True)
def _cache(tmp_path_factory):
    """A compilation cache of this file's runs alone, not the test session's: the pod's four
    processes compile (or load) the same programs, and so reach their first collective together
    (one that loads them all while the others compile could pass gloo's 30 s rendezvous); the
    relaunch and the second pod load what the first compiled."""
    global _CACHE  # noqa: PLW0603 - read by _env in the tests of this module
    _CACHE = str(tmp_path_factory.mktemp("xla-cache"))


_CACHE = None


def _env(devices: int) -> dict:
    """`devices` CPU devices a process, this file's compilation cache, and the checkout on the
    path (the processes run this file as a script, whose own folder is sys.path[0]: the config
    file's `from configs import common` needs the checkout's root)."""
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p),
        "JAX_COMPILATION_CACHE_DIR": _CACHE,
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}",
    }


def _start(tmp_path, name, argv, devices):
    """`python ARGV` with `devices` CPU devices, output in tmp_path/NAME.log."""
    log = open(tmp_path / f"{name}.log", "w")
    cmd = [sys.executable, *argv]
    return subprocess.Popen(cmd, cwd=ROOT, env=_env(devices), stdout=log, stderr=subprocess.STDOUT)


def _pod(tmp_path, name, workdir, steps, *extra, fault=-1, program=None):
    """Start the four processes of `program` (default: train, with `fault`), each with train's
    command line; their output in tmp_path/name-i.log."""
    program = program or [__file__, str(fault)]
    port = _free_port()
    multihost = [
        "--multihost",
        f"--coordinator=localhost:{port}",
        f"--num_processes={PROCESSES}",
        "--heartbeat_timeout=20",
    ]
    return [
        _start(
            tmp_path,
            f"{name}-{i}",
            [*program, *_flags(workdir, steps, *extra), *multihost, f"--process_id={i}"],
            DEVICES_PER_PROCESS,
        )
        for i in range(PROCESSES)
    ]


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


def _logs(tmp_path, name):
    return "\n".join((tmp_path / f"{name}-{i}.log").read_text()[-2000:] for i in range(PROCESSES))


def _maths(workdir):
    from conftest import WALL_CLOCK

    records = metrics.read_jsonl(os.path.join(workdir, metrics.JSONL))
    assert [r["step"] for r in records] == [1, 2]  # no step missing or repeated
    return {r["step"]: {k: v for k, v in r.items() if not k.startswith(WALL_CLOCK)} for r in records}


def _files(folder):
    return {name: open(os.path.join(folder, name), "rb").read() for name in sorted(os.listdir(folder))}


def test_sigterm_to_one_process_stops_all_and_the_relaunch_equals_one_process(tmp_path):
    """One process's uninterrupted 2-step run on the eight devices; the pod's run, process 1
    sent SIGTERM once checkpoint 1 is complete: all four exit 75 within 30 s of it, with no
    checkpoint past the last complete one; relaunched, the pod ends with the one-process run's
    metrics; its last checkpoint exported by the four processes (each writing one of the four
    shard files) equals its export by one process, byte for byte."""
    reference, run = str(tmp_path / "reference"), str(tmp_path / "run")
    one = _start(
        tmp_path, "reference", [__file__, "-1", *_flags(reference, STEPS)], PROCESSES * DEVICES_PER_PROCESS
    )
    assert one.wait(timeout=600) == 0, (tmp_path / "reference.log").read_text()[-3000:]

    procs = _pod(tmp_path, "preempted", run, STEPS)
    first = os.path.join(run, "checkpoints", "1")
    deadline = time.time() + 600
    while not os.path.isdir(first):
        assert time.time() < deadline and all(p.poll() is None for p in procs), _logs(tmp_path, "preempted")
        time.sleep(0.1)
    procs[1].send_signal(signal.SIGTERM)
    t0 = time.time()
    ended = _wait_all(procs, 120)
    print(f"exit status and seconds after the SIGTERM: {[(rc, round(t, 1)) for rc, t in ended]}")
    assert [rc for rc, _ in ended] == [75] * PROCESSES, _logs(tmp_path, "preempted")
    assert max(t for _, t in ended) < 30
    saved = sorted(int(d) for d in os.listdir(os.path.join(run, "checkpoints")) if d.isdigit())
    assert saved and max(saved) < STEPS, saved  # stopped mid-run

    t0 = time.time()
    assert [rc for rc, _ in _wait_all(_pod(tmp_path, "relaunch", run, STEPS), 600)] == [0] * PROCESSES, _logs(
        tmp_path, "relaunch"
    )
    print(f"relaunch: {time.time() - t0:.1f} s")
    expected, got = _maths(reference), _maths(run)
    for step in expected:  # gloo's all-reduces may sum in another order than one process's
        assert got[step].keys() == expected[step].keys()
        for key, value in expected[step].items():
            assert got[step][key] == pytest.approx(value, rel=1e-4, abs=1e-5), (step, key)

    # The last checkpoint exported by four processes and by one: the same bytes, and those of
    # the run's own export (its end, by the four).
    export = ["-m", "dapo_jax.export"]
    pod = _pod(tmp_path, "export", run, STEPS, f"--out={tmp_path / 'pod'}", program=export)
    assert [rc for rc, _ in _wait_all(pod, 300)] == [0] * PROCESSES, _logs(tmp_path, "export")
    one = _start(tmp_path, "export", [*export, *_flags(run, STEPS), f"--out={tmp_path / 'one'}"], 8)
    assert one.wait(timeout=300) == 0, (tmp_path / "export.log").read_text()[-3000:]
    by_four, by_one = _files(tmp_path / "pod"), _files(tmp_path / "one")
    shards = [f"model-0000{i}-of-00004.safetensors" for i in range(1, 5)]
    assert [f for f in by_four if f.endswith(".safetensors")] == shards
    assert by_four.keys() == by_one.keys() and by_four == by_one
    assert _files(os.path.join(run, "export")) == by_one


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
    from dapo_jax import cli, hosts

    score_batch = hosts.SplitScorer.score_batch

    def disagreeing(self, *args, **kwargs):
        results, stats = score_batch(self, *args, **kwargs)
        if hosts.jax.process_index() == fault:
            results = [{**r, "score": -r["score"]} for r in results]
            workdir = next(a.split("=", 1)[1] for a in argv if a.startswith("--workdir="))
            open(os.path.join(workdir, "fault"), "w").close()
        return results, stats

    hosts.SplitScorer.score_batch = disagreeing
    cli.run(cli.train_main, argv=[argv[0], *argv[2:]])


if __name__ == "__main__":
    _fault_main(sys.argv)

"""tpu_setup/ scripts through --dry-run: the gcloud commands they print for a v5p-64 and a v6e-16
slice, quoting preserved; and the workers' side run here: the launch command, as a worker's shell
reads it, starts the trainer with every flag intact, logs into the workdir, and stop.sh's SIGTERM
gives exit status 75; stage.sh's copy runs once per worker."""

import os
import shlex
import subprocess
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TUPLE = "--config.data.train_files=('a b.parquet', \"c's.jsonl\")"
SLICES = [
    ("dapo-v5p", "us-east5-a", "v5p-64", "v2-alpha-tpuv5"),
    ("dapo-v6e", "us-east1-d", "v6e-16", "v2-alpha-tpuv6e"),
]


def _gcloud_calls(script, *args):
    """The argument lists of the gcloud commands that `script --dry-run` prints, as a shell
    running its output passes them (each argument ends in NUL, each call in \\x01)."""
    out = subprocess.run(
        ["bash", os.path.join(ROOT, "tpu_setup", script), "--dry-run", *args],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    fake = 'gcloud() { printf "%s\\0" gcloud "$@"; printf "\\1"; }; eval "$1"'
    replay = subprocess.run(["bash", "-c", fake, "-", out], capture_output=True, text=True, check=True).stdout
    return [call.split("\0")[:-1] for call in replay.split("\1")[:-1]]


def _remote(argv):
    """The --command of an ssh call, checked to be valid shell for the workers."""
    (command,) = [a[len("--command=") :] for a in argv if a.startswith("--command=")]
    subprocess.run(["bash", "-n", "-c", command], check=True)
    return command


def _ssh_head(name, zone, worker="all"):
    return ["gcloud", "compute", "tpus", "tpu-vm", "ssh", name, f"--zone={zone}", f"--worker={worker}"]


@pytest.mark.parametrize("name,zone,accelerator,runtime", SLICES)
def test_create_picks_the_runtime_and_the_capacity(name, zone, accelerator, runtime):
    (direct,) = _gcloud_calls("create.sh", name, zone, accelerator)
    assert direct == [
        "gcloud",
        "compute",
        "tpus",
        "tpu-vm",
        "create",
        name,
        f"--zone={zone}",
        f"--accelerator-type={accelerator}",
        f"--version={runtime}",
    ]
    (queued,) = _gcloud_calls("create.sh", "--queued", "--spot", name, zone, accelerator)
    assert queued == [
        "gcloud",
        "compute",
        "tpus",
        "queued-resources",
        "create",
        name,
        f"--node-id={name}",
        f"--zone={zone}",
        f"--accelerator-type={accelerator}",
        f"--runtime-version={runtime}",
        "--spot",
    ]
    (reserved,) = _gcloud_calls("create.sh", "--queued", "--reserved", name, zone, accelerator)
    assert reserved[-1] == "--reserved"
    (lite,) = _gcloud_calls("create.sh", "--spot", "--on-demand", name, zone, "v5litepod-8")
    assert lite[-1] == "--version=v2-alpha-tpuv5-lite"  # --on-demand: no capacity flag


def test_create_refuses_an_unknown_accelerator_in_one_line():
    r = subprocess.run(
        ["bash", os.path.join(ROOT, "tpu_setup", "create.sh"), "--dry-run", "n", "z", "h100-8"],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2 and "h100-8" in r.stderr and len(r.stderr.splitlines()) == 1


@pytest.mark.parametrize("name,zone,accelerator,runtime", SLICES)
def test_install_copies_the_tree_and_makes_a_python_3_11_venv(name, zone, accelerator, runtime):
    scp, ssh = _gcloud_calls("install.sh", name, zone)
    assert scp[:5] == ["gcloud", "compute", "tpus", "tpu-vm", "scp"]
    assert scp[-3:] == [f"{name}:~/dapo-jax.tar.gz", f"--zone={zone}", "--worker=all"]
    assert ssh[:8] == _ssh_head(name, zone)
    lines = _remote(ssh).splitlines()
    assert (
        lines.index("rm -rf ~/dapo-jax && mkdir -p ~/dapo-jax && tar -xzf ~/dapo-jax.tar.gz -C ~/dapo-jax")
        == 1
    )  # the old copy goes before the new one lands
    assert "~/.local/bin/uv venv --allow-existing --python 3.11 ~/dapo-venv" in lines
    assert lines[-1].endswith(' -e "$HOME/dapo-jax[tpu]"')  # expanded remotely, not a glob


@pytest.mark.parametrize("name,zone,accelerator,runtime", SLICES)
def test_logs_stop_delete_status_address_the_slice(name, zone, accelerator, runtime):
    (logs,) = _gcloud_calls("logs.sh", "--follow", "--worker=3", name, zone)
    assert logs[:8] == _ssh_head(name, zone, "3")
    assert shlex.split(_remote(logs)) == ["tail", "-n", "200", "-F", "~/dapo-logs/train.log"]
    (logs,) = _gcloud_calls("logs.sh", "--job=export", name, zone)
    assert shlex.split(_remote(logs)) == ["tail", "-n", "200", "~/dapo-logs/export.log"]
    (stop,) = _gcloud_calls("stop.sh", name, zone)
    assert stop[:8] == _ssh_head(name, zone) and "kill -TERM" in _remote(stop)
    assert _gcloud_calls("delete.sh", name, zone) == [
        ["gcloud", "compute", "tpus", "tpu-vm", "delete", name, f"--zone={zone}", "--quiet"]
    ]
    assert _gcloud_calls("delete.sh", "--queued", name, zone) == [
        [
            "gcloud",
            "compute",
            "tpus",
            "queued-resources",
            "delete",
            name,
            f"--zone={zone}",
            "--force",
            "--quiet",
        ]
    ]
    queued, vm, workers = _gcloud_calls("status.sh", "--queued", name, zone)
    assert queued[:6] == ["gcloud", "compute", "tpus", "queued-resources", "describe", name]
    assert vm[:6] == ["gcloud", "compute", "tpus", "tpu-vm", "describe", name]
    assert workers[:8] == _ssh_head(name, zone)
    _remote(workers)


def _fake_home(tmp_path):
    """A worker's home: the tree (a link to this checkout) and a venv whose `python` records its
    arguments (NUL-separated), prints a line and waits until SIGTERM, then exits 75."""
    home = tmp_path / "home"
    (home / "dapo-venv" / "bin").mkdir(parents=True)
    os.symlink(ROOT, home / "dapo-jax")
    python = home / "dapo-venv" / "bin" / "python"
    python.write_text(
        '#!/usr/bin/env bash\nprintf "%s\\0" "$@" > "$HOME/argv"\n'
        "echo \"step 1 of a fake run\"\ntrap 'kill $!; exit 75' TERM\n"
        "sleep 60 & wait\n"
    )
    python.chmod(0o755)
    return home


def _on_worker(command, home, **env):
    """`command` run as gcloud's ssh runs it on a worker: by bash, in the worker's home."""
    return subprocess.run(
        ["bash", "-c", command],
        cwd=home,
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, "HOME": str(home), **env},
    )


def _wait_for(path, timeout=20):
    deadline = time.time() + timeout
    while not path.exists():
        assert time.time() < deadline, f"{path} never appeared"
        time.sleep(0.1)


@pytest.mark.parametrize("name,zone,accelerator,runtime", SLICES)
def test_launch_keeps_every_flag_one_argument_and_stop_ends_with_75(
    tmp_path, name, zone, accelerator, runtime
):
    home = _fake_home(tmp_path)
    workdir = tmp_path / "run 1"  # a space: quoted through both shells
    (launch,) = _gcloud_calls(
        "launch.sh", name, zone, "configs/dapo.py:qwen2_5_32b", str(workdir), TUPLE, "--config.seed=3"
    )
    assert launch[:8] == _ssh_head(name, zone)
    assert _on_worker(_remote(launch), home).returncode == 0  # returns at once: detached
    _wait_for(home / "dapo-logs" / "train.pid")
    _wait_for(home / "argv")
    time.sleep(0.5)
    assert (home / "argv").read_text().split("\0")[:-1] == [
        "-m",
        "dapo_jax.train",
        f"--workdir={workdir}",
        "--config=configs/dapo.py:qwen2_5_32b",
        "--multihost",
        TUPLE,
        "--config.seed=3",
    ]
    (status,) = [c for c in _gcloud_calls("status.sh", name, zone) if "--command" in c[-1]]
    assert ": running |" in _on_worker(_remote(status), home).stdout

    (stop,) = _gcloud_calls("stop.sh", name, zone)
    assert "SIGTERM sent" in _on_worker(_remote(stop), home).stdout
    _wait_for(home / "dapo-logs" / "train.status")
    assert (home / "dapo-logs" / "train.status").read_text().strip() == "75"
    logs = list((workdir / "logs").iterdir())  # the log reached the workdir
    assert len(logs) == 1 and "step 1 of a fake run" in logs[0].read_text()
    assert ": exit status 75 |" in _on_worker(_remote(status), home).stdout
    assert "no run" in _on_worker(_remote(stop), home).stdout


def test_stage_copies_once_per_worker(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    gcloud = bin_dir / "gcloud"  # records its call, "copies" one file into the destination
    gcloud.write_text('#!/usr/bin/env bash\necho "$@" >> "$HOME/calls"\ntouch "${@: -1}/config.json"\n')
    gcloud.chmod(0o755)
    (stage,) = _gcloud_calls(
        "stage.sh", "dapo-v5p", "us-east5-a", "gs://bucket/Qwen2.5-32B", "models/qwen 32b"
    )
    assert stage[:8] == _ssh_head("dapo-v5p", "us-east5-a")
    path = f"{bin_dir}:{os.environ['PATH']}"
    for _ in range(2):
        assert _on_worker(_remote(stage), home, PATH=path).returncode == 0
    assert (home / "calls").read_text().splitlines() == [
        "storage rsync --recursive gs://bucket/Qwen2.5-32B models/qwen 32b"
    ]  # once
    assert (home / "models" / "qwen 32b" / "config.json").exists()
    for source, message in (("s3://b/m", "s3://b/m"), ("Qwen/Qwen2.5-32B", "tpu_setup/hub_to_gcs.sh")):
        r = subprocess.run(
            ["bash", os.path.join(ROOT, "tpu_setup", "stage.sh"), "--dry-run", "n", "z", source, "models/q"],
            capture_output=True,
            text=True,
        )
        assert r.returncode == 2 and message in r.stderr  # no Hub download on every worker


def test_a_hub_model_goes_to_the_bucket_once_from_worker_0(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (home / "dapo-venv" / "bin").mkdir(parents=True)
    hf = home / "dapo-venv" / "bin" / "hf"  # "downloads" a config.json into --local-dir
    hf.write_text(
        '#!/usr/bin/env bash\necho hf "$@" >> "$HOME/calls"\nmkdir -p "$4" && touch "$4/config.json"\n'
    )
    gcloud = bin_dir / "gcloud"  # the bucket holds nothing yet
    gcloud.write_text('#!/usr/bin/env bash\necho gcloud "$@" >> "$HOME/calls"\n[ "$2" != ls ]\n')
    for tool in (hf, gcloud):
        tool.chmod(0o755)
    (call,) = _gcloud_calls("hub_to_gcs.sh", "n", "z", "Qwen/Qwen2.5-32B", "gs://b/Qwen2.5-32B")
    assert call[:8] == _ssh_head("n", "z", "0")
    path = f"{bin_dir}:{os.environ['PATH']}"
    assert _on_worker(_remote(call), home, PATH=path).returncode == 0
    calls = (home / "calls").read_text().splitlines()
    assert calls[1] == f"hf download Qwen/Qwen2.5-32B --local-dir {home}/dapo-hub-download"
    assert calls[2].startswith("gcloud storage rsync --recursive") and calls[2].endswith(
        f"{home}/dapo-hub-download gs://b/Qwen2.5-32B"
    )
    assert not (home / "dapo-hub-download").exists()  # the scratch copy is gone


def test_export_and_evaluate_run_on_every_worker_with_multihost():
    for job in ("export", "evaluate"):
        (call,) = _gcloud_calls(
            job + ".sh", "n", "z", "configs/dapo.py:qwen2_5_32b", "gs://b/run 1", "--step=3"
        )
        assert call[:8] == _ssh_head("n", "z")
        command = shlex.split(_remote(call).split("nohup ", 1)[1].split(" >/dev/null")[0])
        assert command == [
            "bash",
            "tpu_setup/worker.sh",
            job,
            "gs://b/run 1",
            "--config=configs/dapo.py:qwen2_5_32b",
            "--multihost",
            "--step=3",
        ]

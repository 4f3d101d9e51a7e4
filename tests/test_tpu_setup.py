"""tpu_setup/ scripts through --dry-run: the gcloud commands they print, quoting preserved."""

import os
import shlex
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TUPLE = "--config.data.train_files=('a b.parquet',)"


def _gcloud_calls(script, *args):
    """The argument lists of the gcloud commands that `script --dry-run` prints, as a shell
    running its output passes them (each argument ends in NUL, each call in \\x01)."""
    out = subprocess.run(["bash", os.path.join(ROOT, "tpu_setup", script), "--dry-run", *args],
                         capture_output=True, text=True, timeout=30, check=True).stdout
    fake = 'gcloud() { printf "%s\\0" gcloud "$@"; printf "\\1"; }; eval "$1"'
    replay = subprocess.run(["bash", "-c", fake, "-", out], capture_output=True, text=True,
                            check=True).stdout
    return [call.split("\0")[:-1] for call in replay.split("\1")[:-1]]


def _remote(argv):
    (command,) = [a[len("--command="):] for a in argv if a.startswith("--command=")]
    subprocess.run(["bash", "-n", "-c", command], check=True)  # valid shell on the workers
    return command


def test_launch_keeps_every_flag_one_argument_on_the_workers():
    (argv,) = _gcloud_calls("launch.sh", "dapo-v5p", "us-east5-a", "configs/dapo.py:qwen2_5_32b",
                            "gs://bucket/run 1", TUPLE, "--config.seed=3")
    assert argv[:8] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "dapo-v5p",
                        "--zone=us-east5-a", "--worker=all"]
    remote = shlex.split(_remote(argv))  # what each worker's shell makes of it
    python = remote.index("~/dapo-venv/bin/python")
    assert remote[:python] == ["cd", "~/dapo-jax", "&&", "nohup"]
    assert remote[python + 1:python + 9] == [
        "-m", "dapo_jax.train", "--config=configs/dapo.py:qwen2_5_32b",
        "--workdir=gs://bucket/run 1", "--multihost", TUPLE, "--config.seed=3", ">"]
    assert remote[python + 9:] == ["~/dapo-train.log", "2>&1", "<", "/dev/null", "&"]


def test_install_copies_the_tree_and_makes_a_python_3_11_venv():
    scp, ssh = _gcloud_calls("install.sh", "dapo-v6e", "us-east1-d")
    assert scp[:4] == ["gcloud", "compute", "tpus", "tpu-vm"] and scp[4] == "scp"
    assert scp[-3:] == ["dapo-v6e:~/dapo-jax.tar.gz", "--zone=us-east1-d", "--worker=all"]
    assert ssh[4:8] == ["ssh", "dapo-v6e", "--zone=us-east1-d", "--worker=all"]
    lines = _remote(ssh).splitlines()
    assert lines.index("rm -rf ~/dapo-jax && mkdir -p ~/dapo-jax && tar -xzf ~/dapo-jax.tar.gz "
                       "-C ~/dapo-jax") == 1  # the old copy goes before the new one lands
    assert "~/.local/bin/uv venv --allow-existing --python 3.11 ~/dapo-venv" in lines
    assert lines[-1].endswith(' -e "$HOME/dapo-jax[tpu]"')  # expanded remotely, not a glob


def test_create_picks_the_runtime_of_the_generation():
    (direct,) = _gcloud_calls("create.sh", "dapo-v5p", "us-east5-a", "v5p-64")
    assert direct == ["gcloud", "compute", "tpus", "tpu-vm", "create", "dapo-v5p",
                      "--zone=us-east5-a", "--accelerator-type=v5p-64",
                      "--version=v2-alpha-tpuv5"]
    (queued,) = _gcloud_calls("create.sh", "--queued", "--spot", "dapo-v6e", "us-east1-d",
                              "v6e-16")
    assert queued == ["gcloud", "compute", "tpus", "queued-resources", "create", "dapo-v6e",
                      "--node-id=dapo-v6e", "--zone=us-east1-d", "--accelerator-type=v6e-16",
                      "--runtime-version=v2-alpha-tpuv6e", "--spot"]
    (lite,) = _gcloud_calls("create.sh", "--reserved", "d", "z", "v5litepod-8")
    assert lite[-2:] == ["--version=v2-alpha-tpuv5-lite", "--reserved"]

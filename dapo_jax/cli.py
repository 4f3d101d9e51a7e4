"""The command line of `python -m dapo_jax.train`, `dapo_jax.evaluate` and `dapo_jax.export`: the
flags they share (--config with its `--config.a.b=` overrides, --workdir, the multi-process ones),
one-line errors for a bad config file, variant or key, and the training run's own entry point.

Exit status: 0 done, 2 a bad config, checkpoint or missing file (one line on stderr), 1 a crash
or a disagreement between processes, 75 preempted (`preemption.PREEMPTED`).
"""

from __future__ import annotations

import sys

import jax
import ml_collections
from absl import app, flags, logging
from ml_collections import config_flags

from dapo_jax import config_schema, evaluation, metrics, overrides, paths, train
from dapo_jax.errors import ConfigError, one_line_errors
from dapo_jax.run import load_config_file

CONFIG = config_flags.DEFINE_config_file("config", None, "configs/FILE.py:VARIANT", lock_config=True)
WORKDIR = flags.DEFINE_string("workdir", None, "run directory: checkpoints, metrics, export")
_MULTIHOST = flags.DEFINE_bool("multihost", False, "call jax.distributed.initialize() first")
_COORDINATOR = flags.DEFINE_string(
    "coordinator",
    None,
    "with --multihost: process 0's host:port, where JAX does not detect the "
    "cluster by itself (it does on TPU pods and SLURM)",
)
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "with --coordinator: how many")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "with --coordinator: this one's, 0-based")
_HEARTBEAT = flags.DEFINE_integer(
    "heartbeat_timeout",
    100,
    "with --multihost: seconds without a heartbeat after which JAX's "
    "coordination service declares a process dead and the others stop",
    lower_bound=1,
)
_CHECKPOINT_DIR = flags.DEFINE_string(
    "checkpoint_dir",
    None,
    "train: where the checkpoints are (default WORKDIR/checkpoints), a folder "
    "every process sees, e.g. gs://..., when the processes' workdirs are apart",
)


def _bad_override(config, argv) -> str | None:
    """The first `--config.a.b=...` of argv naming no key of `config`, told with the valid keys,
    or setting None where the key's schema has no None (config_flags cannot parse it)."""
    for arg in argv:
        if arg.startswith("--config."):
            flag, _, value = arg.partition("=")
            key = flag[len("--config.") :]
            try:
                overrides.get(config, key)
            except ConfigError as e:
                return f"{flag}: {e}"
            leaves = dict(config_schema.fields(config))
            if value == "None" and key in leaves and config_schema.problem(key, leaves[key], None):
                return f"{flag}: {config_schema.problem(key, leaves[key], None)}"
    return None


def _config_without_overrides(argv) -> ml_collections.ConfigDict | None:
    spec = next((a.split("=", 1)[1] for a in argv if a.startswith("--config=")), None)
    if spec is None:
        return None
    path, _, arg = spec.partition(":")
    try:
        module = load_config_file(path)
        return module.get_config(arg) if arg else module.get_config()
    except Exception:  # noqa: BLE001 - the original error is reported instead
        return None


def parse_flags(argv):
    """absl flag parsing with one-line errors for a bad config file, variant, override key or
    value. A key whose schema allows None takes `--config.a.b=None` as well as a value
    (`config_schema`)."""
    try:
        args = flags.FLAGS(argv)
        if CONFIG.value is not None:  # config_flags loads the file and applies overrides lazily
            CONFIG.value.keys()
        return args
    except Exception as e:  # noqa: BLE001 - config_flags raises whatever the config file raised
        config = _config_without_overrides(argv)
        message = _bad_override(config, argv) if config is not None else None
        print(f"error: {message or str(e).strip().splitlines()[-1].strip()}", file=sys.stderr)
        sys.exit(2)


def quiet_logging() -> None:
    """WARNING and above unless --verbosity says otherwise: orbax logs every save and restore
    at INFO."""
    if not flags.FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)


def start_distributed() -> None:
    """With --multihost, `jax.distributed.initialize` (and gloo for CPU devices' collectives):
    each command's first act, before anything starts JAX's backends."""
    if _MULTIHOST.value:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        # CPU programs one after the other: with XLA:CPU's asynchronous dispatch, a process of the
        # four-process CPU pod (tests/test_pod.py) blocked in dispatching the rollout weights'
        # copy while the others waited in a collective (jax#25861); accelerators are unaffected.
        jax.config.update("jax_cpu_enable_async_dispatch", False)
        jax.distributed.initialize(
            _COORDINATOR.value,
            _NUM_PROCESSES.value,
            _PROCESS_ID.value,
            heartbeat_timeout_seconds=_HEARTBEAT.value,
        )


def start(argv, *required: str) -> None:
    """A command's first lines: no positional arguments, quiet logging, the distributed runtime,
    and the flags it cannot run without."""
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}")
    quiet_logging()
    start_distributed()
    missing = [f"--{name}" for name in required if flags.FLAGS[name].value is None]
    if missing:
        raise app.UsageError(f"{' and '.join(missing)} required")


def run(main, argv=None) -> None:
    """`app.run(main)` with this module's flag parsing."""
    app.run(main, argv=argv, flags_parser=parse_flags)


def train_main(argv) -> None:
    """`python -m dapo_jax.train --config=configs/dapo.py:tiny --workdir=DIR`: the run, then its
    report (process 0)."""
    start(argv, "config", "workdir")
    c, workdir = CONFIG.value, WORKDIR.value
    with one_line_errors():
        summary = train.train(c, workdir, _CHECKPOINT_DIR.value)
    if jax.process_index() == 0:
        report(workdir, summary, c.train.steps)


def report(workdir: str, summary: dict, steps: int) -> None:
    """Plots the run's curves and prints held-out accuracy before and after, and where things are."""
    root = paths.run_path(workdir)
    path = root / metrics.JSONL
    if not path.is_file():
        return
    if not summary:
        print(f"{workdir} has already finished its {steps} steps")
    from dapo_jax import plot  # noqa: PLC0415 - matplotlib, for the report only

    plot.plot_runs([workdir], str(root / "plots"))
    evals = [r for r in metrics.read_jsonl(path) if any(k.startswith("eval/") for k in r)]
    if evals:
        print(f"held-out accuracy before (step {evals[0]['step']}): {evaluation.summary_text(evals[0])}")
        print(f"held-out accuracy after (step {evals[-1]['step']}):  {evaluation.summary_text(evals[-1])}")
        gain = evaluation.gain_text(evals[0], evals[-1]) if len(evals) > 1 else None
        if gain:
            print(gain)
    print(f"curves: {root / 'plots'}")
    export = root / "export"
    if export.is_dir():
        print(f"exported model: {export}")

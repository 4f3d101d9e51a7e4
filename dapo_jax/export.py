"""Any checkpoint of a run as a Hugging Face model directory:

    python -m dapo_jax.export --config=configs/dapo.py:tiny --workdir=runs/tiny [--step=20] \
        [--out=DIR] [--dtype=bfloat16] [--push_to_hub=user/name]

The config is the run's (with the same overrides: it names the base model, whose config.json,
tokenizer and generation_config.json go beside the weights). `--step` defaults to the newest
checkpoint, `--out` to `<workdir>/export_step_<N>`, `--dtype` to the config's `export.dtype`.
The folder is written as the end of a run writes `<workdir>/export` (`train.export_hf`) and
checked as a load checks it. On a pod slice, run it on every host with `--multihost` (as train):
each process writes its own safetensors shards into `--out` when it is a folder every process
sees (gs://...); where each process sees a folder of its own disk, process 0 writes them all.
`--push_to_hub` uploads it to that Hub model repo (created if missing, private unless
`--public`); nothing touches the network without it.
"""

from __future__ import annotations

import copy
import os

import jax
from absl import flags

from dapo_jax import checkpoint, cli, hub, paths, train
from dapo_jax.config_checks import check_config
from dapo_jax.errors import ConfigError, one_line_errors
from dapo_jax.run import Run, build
from dapo_jax.train_step import TrainState

DTYPES = ("float32", "bfloat16", "float16")


def without_train_data(c):
    """A copy of `c` that reads its eval files in place of its train files (where it has eval
    files): a run built to evaluate or export samples no training prompt."""
    c = copy.deepcopy(c)  # keeps each key's schema (config_schema.Field)
    if c.data.eval_files:
        c.data.train_files = tuple(c.data.eval_files)
    return c


def restore(c, workdir: str, step: int | None = None) -> tuple[Run, TrainState, int]:
    """The run of config `c` and its train state restored from checkpoint `step` of `workdir`
    (default the newest); a ConfigError naming the steps there are when it has no such one."""
    c = hub.resolve_config(without_train_data(c))
    check_config(c)
    directory = paths.run_path(workdir) / "checkpoints"
    if not directory.is_dir():
        raise ConfigError(f"workdir {workdir!r} has no checkpoints ({directory} does not exist)")
    ckpt = checkpoint.Checkpointer(workdir, read_only=True)  # the run may still be saving
    try:
        steps = ckpt.agreed_steps()  # every process of a --multihost export the same step
        step = max(steps, default=None) if step is None else step
        if step not in steps:
            raise ConfigError(
                f"workdir {workdir!r} has no checkpoint of step {step}; its steps: {sorted(steps)}"
            )
        run = build(c, workdir)
        state, _ = ckpt.restore(step, run.abstract_state())
    finally:
        ckpt.close()
    return run, state, step


def export(
    c,
    workdir: str,
    step: int | None = None,
    out: str | None = None,
    dtype: str | None = None,
    push_to_hub: str | None = None,
    private: bool = True,
) -> tuple[str, int]:
    """Writes checkpoint `step` of `workdir` as a Hugging Face folder; returns (folder, step)."""
    if dtype is not None and dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype!r} is not one of {DTYPES}")
    run, state, step = restore(c, workdir, step)
    try:
        out = train.export_hf(run, state.params, out or os.path.join(workdir, f"export_step_{step}"), dtype)
    finally:
        run.scorer.close()
    if push_to_hub and jax.process_index() == 0:
        import huggingface_hub  # pylint: disable=import-outside-toplevel

        api = huggingface_hub.HfApi()
        api.create_repo(push_to_hub, private=private, exist_ok=True)
        api.upload_folder(
            folder_path=out, repo_id=push_to_hub, commit_message=f"dapo-jax export of {workdir} step {step}"
        )
    return out, step


def _define_flags():
    """This command's flags beside train's --config (with overrides) and --workdir."""
    flags.DEFINE_integer("step", None, "checkpoint step to export (default: the newest)")
    flags.DEFINE_string("out", None, "output folder (default: <workdir>/export_step_<N>)")
    flags.DEFINE_enum("dtype", None, list(DTYPES), "weight dtype (default: export.dtype)")
    flags.DEFINE_string("push_to_hub", None, "also upload the folder to this Hub model repo")
    flags.DEFINE_bool("public", False, "with --push_to_hub: create the repo public")


def main(argv):
    cli.start(argv, "config", "workdir")
    f = flags.FLAGS
    with one_line_errors():
        out, step = export(f.config, f.workdir, f.step, f.out, f.dtype, f.push_to_hub, private=not f.public)
    if jax.process_index() != 0:
        return
    print(
        f"exported step {step} of {f.workdir} to {out}"
        + (f" and https://huggingface.co/{f.push_to_hub}" if f.push_to_hub else "")
    )


if __name__ == "__main__":
    _define_flags()
    cli.run(main)

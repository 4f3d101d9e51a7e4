"""The config's checks, before anything loads or compiles: one-line `ConfigError`s that name the
key and the fix (out-of-range values, missing folders and files, sizes that do not fit one
another or the devices, settings that contradict each other)."""

from __future__ import annotations

import importlib.util
import os

import jax
import ml_collections
from etils import epath

from dapo_jax import (
    config_schema,
    data,
    hf_io,
    metrics,
    programs,
    rewards,
    sizes,
)
from dapo_jax.errors import ConfigError
from dapo_jax.run import make_filter


def check_ranges(c: ml_collections.ConfigDict) -> None:
    """A ConfigError naming the first key whose value its schema does not take (type, range,
    allowed values, None: `config_schema.check`)."""
    config_schema.check(c)


def check_workdir(workdir: str) -> None:
    """A ConfigError when the workdir, or a folder above it, exists as something else than a
    folder."""
    path = epath.Path(workdir)
    for p in (path, *path.parents):
        if p.exists():
            if not p.is_dir():
                raise ConfigError(f"workdir {workdir!r}: {str(p)!r} is a file, not a folder")
            return


def check_config(c: ml_collections.ConfigDict, num_devices: int | None = None) -> None:
    """One-line errors for out-of-range values, missing paths, bad data files and inconsistent
    sizes, before any compilation. The batch sizes are checked against `num_devices` devices
    (default: this run's)."""
    check_ranges(c)
    _check_paths(c)
    _check_sizes(c, num_devices)
    _check_old_logp(c)
    for section, make in (
        ("loss", lambda: programs.loss_config(c)),
        ("reward", lambda: rewards.get_reward_fn(c.reward.fn)),
        ("filter", lambda: make_filter(c)),
    ):
        try:  # the constructors' own checks (a reward plug-in is imported here, once, to check
            make()  # it), run now rather than after the model has loaded
        except (ValueError, ImportError) as e:
            raise ConfigError(f"config.{section}: {e}") from None
    _check_tracking(c)


def _check_paths(c: ml_collections.ConfigDict) -> None:
    """The model, reference and tokenizer folders and the data files exist and read."""

    def need_file(path, what):
        if not os.path.exists(path):
            raise ConfigError(f"{what} {path!r} does not exist")

    need_file(os.path.join(c.model.path, "config.json"), "base model (config.model.path): file")
    if c.loss.beta > 0:
        if not c.reference.path:
            raise ConfigError("loss.beta > 0 needs a reference model: set config.reference.path")
        need_file(os.path.join(c.reference.path, "config.json"), "reference model: file")
    tokenizer_dir = c.model.tokenizer_path or c.model.path
    if not hf_io.has_tokenizer(tokenizer_dir):
        raise ConfigError(
            f"tokenizer directory {tokenizer_dir!r} holds no tokenizer (one of "
            f"{', '.join(hf_io.TOKENIZER_FILES)}): set model.tokenizer_path to the "
            "folder of the model's tokenizer"
        )
    if not c.data.train_files:
        raise ConfigError("config.data.train_files is empty")
    for f in list(c.data.train_files) + list(c.data.eval_files):
        data.check_data_file(f)


def _check_sizes(c: ml_collections.ConfigDict, num_devices: int | None) -> None:
    """Prompt buckets, the overlong buffer and the batch sizes fit one another and the devices
    (`sizes.check_batch_sizes`: what pads and what must divide)."""
    if not c.data.prompt_buckets or min(c.data.prompt_buckets) < 1:
        raise ConfigError(f"data.prompt_buckets must be positive lengths, got {tuple(c.data.prompt_buckets)}")
    if c.data.max_prompt_len > max(c.data.prompt_buckets):
        raise ConfigError(
            f"data.max_prompt_len {c.data.max_prompt_len} exceeds the largest "
            f"prompt bucket {max(c.data.prompt_buckets)}"
        )
    if c.reward.overlong_buffer > c.rollout.max_new_tokens:
        raise ConfigError(
            f"reward.overlong_buffer {c.reward.overlong_buffer} exceeds "
            f"rollout.max_new_tokens {c.rollout.max_new_tokens}"
        )
    if num_devices is None:
        num_devices = jax.device_count()
    sizes.check_batch_sizes(c, num_devices)


def _check_old_logp(c: ml_collections.ConfigDict) -> None:
    """Without a recompute pi_old is exact:
    "detached" needs one update per rollout batch, and neither takes carried-over groups (sampled
    under the params before the last update, so their sampler log-probs are not pi_old's)."""
    mode = c.loss.old_logp
    if mode == "detached" and c.train.train_batch_prompts != c.train.mini_batch_prompts:
        raise ConfigError(
            "loss.old_logp 'detached' needs one update per rollout batch (train.mini_batch_prompts "
            f"= train.train_batch_prompts), got {c.train.train_batch_prompts // c.train.mini_batch_prompts} "
            "updates: use 'recompute' or 'sampler'"
        )
    for key in ("param_dtype", "dtype"):
        if mode == "sampler" and c.rollout[key] not in (None, c.model[key]):
            raise ConfigError(
                f"loss.old_logp 'sampler' with rollout.{key} {c.rollout[key]!r}: the sampler's log-probs "
                f"are not pi_old of the trainer's {c.model[key]} model: use 'recompute' or 'detached'"
            )
    if mode != "recompute" and (c.loss.rollout_is or c.loss.rollout_rs):
        raise ConfigError(
            f"loss.rollout_is / rollout_rs with loss.old_logp {mode!r}: the correction weighs "
            "pi_old / pi_sampler, 1 when pi_old is the sampler's: use loss.old_logp 'recompute'"
        )
    if mode != "recompute" and c.filter.carry_over:
        raise ConfigError(
            f"loss.old_logp {mode!r} with filter.carry_over: carried groups were sampled before the "
            "last update, so pi_old of them must be recomputed: use loss.old_logp 'recompute'"
        )


def profile_steps(spec: str) -> set[int]:
    """The steps of `profile.steps`, "a,b" (empty: none); ConfigError for anything else."""
    try:
        steps = {int(s) for s in str(spec).split(",") if s.strip()}
    except ValueError:
        steps = {0}
    if min(steps, default=1) < 1:
        raise ConfigError(f"profile.steps {spec!r}: comma-separated step numbers >= 1, e.g. '3,4'")
    return steps


def _check_tracking(c: ml_collections.ConfigDict) -> None:
    """metrics.writers names known writers (and wandb is installed when named), profile.steps
    are step numbers."""
    try:
        writers = metrics.parse_writers(c.metrics.writers)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if "wandb" in writers and importlib.util.find_spec("wandb") is None:
        raise ConfigError(
            "metrics.writers names wandb, which is not installed: pip install wandb "
            "(or the project's extra: pip install -e .[tracking])"
        )
    profile_steps(c.profile.steps)

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
    data,
    hf_io,
    metrics,
    objective,
    overrides,
    programs,
    rewards,
    sharding,
    sizes,
    train_step,
)
from dapo_jax.errors import ConfigError
from dapo_jax.run import make_filter

# The range of every numeric knob, as an interval: "[a, b)" includes a and excludes b.
_RANGES = {
    "cpu_devices": "[0, inf)",
    "train.steps": "[1, inf)",
    "train.train_batch_prompts": "[1, inf)",
    "train.mini_batch_prompts": "[1, inf)",
    "train.micro_batch_size": "[1, inf)",
    "train.length_bucket": "[1, inf)",
    "train.max_consecutive_nonfinite": "[1, inf)",
    "rollout.group_size": "[1, inf)",
    "rollout.max_new_tokens": "[1, inf)",
    "rollout.temperature": "(0, inf)",
    "rollout.top_p": "(0, 1]",
    "rollout.top_k": "[0, inf)",
    "data.max_prompt_len": "[1, inf)",
    "loss.eps_low": "[0, 1)",
    "loss.eps_high": "[0, inf)",
    "loss.clip_ratio_c": "[0, inf)",
    "loss.norm_const": "[0, inf)",
    "loss.beta": "[0, inf)",
    "loss.entropy_coef": "[0, inf)",
    "optim.lr": "(0, inf)",
    "optim.warmup_rollout_steps": "[0, inf)",
    "optim.weight_decay": "[0, inf)",
    "optim.grad_clip": "(0, inf)",
    "optim.b1": "[0, 1)",
    "optim.b2": "[0, 1)",
    "optim.eps": "(0, inf)",
    "reward.timeout_s": "(0, inf)",
    "reward.num_workers": "[1, inf)",
    "reward.overlong_buffer": "[1, inf)",
    "reward.overlong_factor": "[0, inf)",
    "filter.gen_batch_prompts": "[1, inf)",
    "filter.max_num_gen_batches": "[0, inf)",
    "checkpoint.every": "[1, inf)",
    "checkpoint.every_minutes": "[0, inf)",
    "export.max_shard_bytes": "[1, inf)",
    "checkpoint.keep": "[1, inf)",
    "eval.every": "[0, inf)",
    "metrics.completions_every": "[0, inf)",
    "metrics.completions_rows": "[1, inf)",
    "metrics.completions_chars": "[0, inf)",
    "eval.samples": "[1, inf)",
    "eval.temperature": "(0, inf)",
    "eval.top_p": "(0, 1]",
    "eval.max_problems": "[0, inf)",
    "eval.batch_prompts": "[1, inf)",
    "eval.micro_batch_prompts": "[0, inf)",
    "model.attention_chunk": "[0, inf)",
    "model.logits_chunk": "[0, inf)",
    "rollout.micro_batch_prompts": "[0, inf)",
    "rollout.decode_slots": "[0, inf)",
    "rollout.decode_chunks": "[1, inf)",
    "rollout.page_size": "[1, inf)",
    "rollout.kv_pages": "[0, inf)",
    "rollout.tensor_parallel": "[0, inf)",
}


def in_interval(value: float, interval: str) -> bool:
    """Whether `value` lies in `interval`, written "[a, b]", "(a, b)", "[a, inf)" and so on."""
    lo, hi = (float(x) for x in interval[1:-1].split(","))
    above = value >= lo if interval[0] == "[" else value > lo
    below = value <= hi if interval[-1] == "]" else value < hi
    return above and below


def check_ranges(c: ml_collections.ConfigDict) -> None:
    """A ConfigError naming the first knob of `_RANGES` whose value lies outside its range."""
    for key, interval in _RANGES.items():
        value = overrides.get(c, key)
        if not in_interval(value, interval):
            raise ConfigError(f"{key} must be in {interval}, got {value!r}")


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
    (default: this run's, after `c.cpu_devices` has split a CPU-only host)."""
    check_ranges(c)
    _check_paths(c)
    _check_sizes(c, num_devices)
    _check_micro_batches(c)
    if 0 < c.loss.clip_ratio_c <= 1:
        raise ConfigError(f"loss.clip_ratio_c must be 0 (off) or > 1, got {c.loss.clip_ratio_c}")
    if not hasattr(jax.checkpoint_policies, c.model.remat_policy):
        raise ConfigError(
            f"model.remat_policy {c.model.remat_policy!r} is not a "
            "jax.checkpoint_policies name (e.g. nothing_saveable)"
        )
    _check_old_logp(c)
    for key in ("param_dtype", "dtype"):
        if c.rollout[key] not in ("", "float32", "bfloat16"):
            raise ConfigError(
                f"rollout.{key} {c.rollout[key]!r} is not '' (the trainer's), 'float32' or 'bfloat16'"
            )
    if c.loss.agg_mode not in objective.AGG_MODES:
        raise ConfigError(f"loss.agg_mode {c.loss.agg_mode!r} is not one of {objective.AGG_MODES}")
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
        sharding.use_cpu_devices(c.cpu_devices)
        num_devices = jax.device_count()
    sizes.check_batch_sizes(c, num_devices)


def _check_micro_batches(c: ml_collections.ConfigDict) -> None:
    """An eval batch splits into whole micro-batches: one compiled eval program."""
    if c.eval.micro_batch_prompts and c.eval.batch_prompts % c.eval.micro_batch_prompts:
        raise ConfigError(
            f"eval.batch_prompts {c.eval.batch_prompts} is not a multiple of "
            f"eval.micro_batch_prompts {c.eval.micro_batch_prompts}"
        )


def _check_old_logp(c: ml_collections.ConfigDict) -> None:
    """loss.old_logp is one of train_step.OLD_LOGP, and without a recompute pi_old is exact:
    "detached" needs one update per rollout batch, and neither takes carried-over groups (sampled
    under the params before the last update, so their sampler log-probs are not pi_old's)."""
    mode = c.loss.old_logp
    if mode not in train_step.OLD_LOGP:
        raise ConfigError(f"loss.old_logp {mode!r} is not one of {train_step.OLD_LOGP}")
    if mode == "detached" and c.train.train_batch_prompts != c.train.mini_batch_prompts:
        raise ConfigError(
            "loss.old_logp 'detached' needs one update per rollout batch (train.mini_batch_prompts "
            f"= train.train_batch_prompts), got {c.train.train_batch_prompts // c.train.mini_batch_prompts} "
            "updates: use 'recompute' or 'sampler'"
        )
    for key in ("param_dtype", "dtype"):
        if mode == "sampler" and c.rollout[key] not in ("", c.model[key]):
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

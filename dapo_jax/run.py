"""One run's pieces: the mesh, model, tokenizer, data, samplers, compiled steps and reward
workers that the loop in `train.py` drives (the config checked first: `config_checks`).

Every knob comes from the config (configs/*.py); nothing here has a default of its own.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os

import jax
import ml_collections
from absl import logging

from dapo_jax import (
    data,
    dynamic_sampling,
    engine_plan,
    hf_io,
    hf_model_config,
    host_memory,
    hosts,
    model,
    paths,
    programs,
    rewards,
    rollout,
    train_step,
)
from dapo_jax.errors import ConfigError
from dapo_jax.sampler import Sampler


@dataclasses.dataclass(frozen=True)
class Run:
    """The built, immutable pieces of one run (`build`). The loop in `train.py` holds what
    changes: the train state, the data order and the dynamic-sampling filter."""

    config: ml_collections.ConfigDict
    workdir: str
    mesh: jax.sharding.Mesh
    hf_config: dict
    tokenizer: object
    model: model.Transformer
    optimizer: object
    train_step: object  # (state, mini-batch) -> (state, metrics), jitted and donated
    logprobs_fn: object  # (params, tokens, mask) -> log pi(token_t | tokens_<t)
    sampler: Sampler
    eval_sampler: Sampler
    rollout_weights: object  # trainer params -> the samplers' params (`Programs.rollout_weights`)
    scorer: hosts.SplitScorer  # a RewardScorer's rows split over the processes
    shaping: rollout.RewardShaping
    train_examples: list  # in load order; `data.PromptIterator` draws from them
    eval_examples: list
    ref_params: object = None

    programs: programs.Programs | None = None  # what the fields above came from

    def abstract_state(self) -> train_step.TrainState:
        """The train state as ShapeDtypeStructs with their shardings: a checkpoint's restore target."""
        return self.programs.abstract_state()


def load_config_file(path: str):
    """The config module at `path` (a configs/*.py file), loaded by path: configs are data that
    the library never imports as a package."""
    spec = importlib.util.spec_from_file_location("_dapo_config", path)
    if spec is None or not os.path.isfile(path):
        raise FileNotFoundError(f"config file {path} does not exist")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _load_prompts(files, tokenizer, c, dedup):
    examples = []
    for f in files:
        loaded = data.load_prompts(
            f,
            tokenizer,
            c.data.max_prompt_len,
            template=c.data.prompt_template,
            use_chat_template=c.data.use_chat_template,
            dedup=dedup,
        )
        logging.info(
            "%s: %d prompts (%d malformed, %d duplicates, %d truncated, %d quoting the prompt template)",
            f,
            len(loaded.examples),
            loaded.n_malformed,
            loaded.n_duplicates,
            loaded.n_truncated,
            loaded.n_template_mismatch,
        )
        examples += loaded.examples
    return examples


def _ids(x) -> tuple[int, ...]:
    return () if x is None else tuple(x) if isinstance(x, (list, tuple)) else (x,)


_MODEL_FOLDERS = ("path", "tokenizer_path")  # the model section's keys that are not ModelConfig's


def model_numerics(c: ml_collections.ConfigDict) -> dict:
    """The ModelConfig fields that the config sets: every key of its `model` section but the
    folders (dtype, param_dtype, remat, ...), and the layer scan and key layout of `cpu_variants`
    (the rest come from config.json)."""
    numerics = {k: v for k, v in c.model.items() if k not in _MODEL_FOLDERS}
    return {**numerics, "scan_layers": not c.cpu_variants, "transposed_keys": c.cpu_variants}


def use_compilation_cache(workdir: str) -> str:
    """Keep every compiled program in `<workdir>/compilation_cache` (the environment's
    JAX_COMPILATION_CACHE_DIR instead where it is set; a gs:// folder is shared by every host of a
    slice), however fast it compiled, so that a relaunch or another host reads it back instead
    of compiling it again. Set before anything compiles; returns the folder."""
    path = os.environ.get("JAX_COMPILATION_CACHE_DIR") or str(paths.run_path(workdir) / "compilation_cache")
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    logging.info("compilation cache: %s", path)
    return path


def build(c: ml_collections.ConfigDict, workdir: str) -> Run:
    """The mesh, model, tokenizer, data, samplers, compiled steps (`programs.build`) and reward
    workers."""
    use_compilation_cache(workdir)
    if c.cpu_variants:
        host_memory.tune_for_xla_cpu()
    numerics = model_numerics(c)
    hf_config, mcfg = hf_io.check_model_folder(c.model.path, **numerics)
    if c.loss.beta > 0 and hf_io.check_model_folder(c.reference.path, **numerics)[1] != mcfg:
        raise ConfigError(
            f"reference.path {c.reference.path!r} is not a model of the "
            f"architecture and sizes of model.path {c.model.path!r}"
        )
    tokenizer = hf_io.load_tokenizer(c.model.tokenizer_path or c.model.path)
    hf_model_config.check_vocab(mcfg, tokenizer, os.path.join(c.model.path, "config.json"))
    eos = tuple(sorted({tokenizer.eos_token_id, *_ids(hf_config.get("eos_token_id"))}))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    p = programs.build(c, mcfg, eos, pad, hbm=engine_plan.device_hbm(jax.local_devices()[0]))
    overlong = ("overlong_buffer", "overlong_factor", "overlong_penalty", "overlong_filter")
    shaping = rollout.RewardShaping(c.rollout.max_new_tokens, **{k: c.reward[k] for k in overlong})
    eval_examples = _load_prompts(c.data.eval_files, tokenizer, c, dedup=True)
    if c.eval.max_problems:
        eval_examples = eval_examples[: c.eval.max_problems]
    train_examples = _load_prompts(c.data.train_files, tokenizer, c, c.data.dedup)
    ref_params = hf_io.load_params(c.reference.path, p.model, p.mesh) if c.loss.beta > 0 else None
    scorer = hosts.SplitScorer(
        rewards.RewardScorer(rewards.get_reward_fn(c.reward.fn), c.reward.timeout_s, c.reward.num_workers)
    )
    return Run(
        c,
        workdir,
        p.mesh,
        hf_config,
        tokenizer,
        p.model,
        p.optimizer,
        p.train_step,
        p.logprobs_fn,
        p.sampler,
        p.eval_sampler,
        p.rollout_weights,
        scorer,
        shaping,
        train_examples,
        eval_examples,
        ref_params,
        p,
    )


def make_filter(c: ml_collections.ConfigDict) -> dynamic_sampling.DynamicSampler:
    """The config's dynamic-sampling filter (config.filter), empty."""
    return dynamic_sampling.DynamicSampler(
        c.train.train_batch_prompts,
        c.rollout.group_size,
        c.filter.max_num_gen_batches,
        enable=c.filter.enable,
        metric=c.filter.metric,
        carry_over=c.filter.carry_over,
        on_exhausted=c.filter.on_exhausted,
    )

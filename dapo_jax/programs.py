"""The run's meshes and compiled programs, built once from the config, and the abstract inputs of
each: `run.build` (train, evaluate, export) and the AOT check (`aot.py`) take them from here, so
that the AOT check compiles exactly the programs a run compiles.

- the trainer's mesh (`config.mesh`) and the rollout's: data x the trainer's tensor axis over the
  same devices (fsdp folded into data: no weight gathered per decoded token);
- `train_step(state, mini-batch)`: one update, the state donated (trainer's mesh);
- `logprobs_fn(params, tokens_BxT, mask_BxT)`: log pi_old of a rollout batch (trainer's mesh);
- `rollout_weights(params)`: the trainer's params as the samplers' weights, cast to
  `rollout.param_dtype` by one compiled program, then moved onto the rollout's mesh;
- `sampler` / `eval_sampler`: the rollout's program (`Sampler.program`: one call's prompts x G
  rows) and the evaluation's (x `eval.samples` rows), on the rollout's mesh and dtypes; the
  engine's slots and a call's prompts from the chip's memory (`engine_plan`), all at once
  where it reports none (XLA:CPU) and with the fixed batch (`cpu_variants`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from jax.sharding import Mesh

from dapo_jax import engine_plan, logprobs, model, sharding, sizes, train_step
from dapo_jax.decoding import SamplingConfig
from dapo_jax.sampler import Sampler

GIB = 2**30


@dataclasses.dataclass(frozen=True)
class Programs:
    """The meshes, models and compiled programs of one run (`build`)."""

    mesh: Mesh  # the trainer's
    rollout_mesh: Mesh  # the samplers'
    model: model.Transformer  # the trainer's
    rollout_model: model.Transformer  # the samplers': rollout.param_dtype / dtype, no remat
    optimizer: object
    train_step: object  # (state, mini-batch) -> (state, metrics), jitted and donated
    logprobs_fn: object  # (params, tokens_BxT, mask_BxT) -> logp_BxT
    sampler: Sampler
    eval_sampler: Sampler
    cast: object  # jitted: trainer params -> rollout dtype on the trainer's mesh; None: as they lie
    sizes: ProgramSizes  # the rows and lengths each program is compiled for

    def rollout_weights(self, params):
        """The samplers' weights made from the trainer's `params` (once per step): the same
        arrays, or cast by the one compiled `cast` and moved onto the rollout mesh's layout."""
        if self.cast is None:
            return params
        layout = sharding.param_shardings(self.rollout_model, self.rollout_mesh)
        return jax.device_put(self.cast(params), layout)

    def abstract_state(self) -> train_step.TrainState:
        """The train state as ShapeDtypeStructs with their shardings (a checkpoint's restore
        target; the train step's first argument)."""
        return abstract_state(self.model, self.optimizer, self.mesh)


def abstract_state(m: model.Transformer, optimizer, mesh: Mesh) -> train_step.TrainState:
    """The train state of `m` and `optimizer` on `mesh` as ShapeDtypeStructs with shardings."""
    abstract = jax.eval_shape(
        lambda p: train_step.TrainState(jnp.zeros((), jnp.int32), p, optimizer.init(p)),
        sharding.abstract_params(m),
    )
    return sharding.with_shardings(abstract, train_step.state_shardings(m, optimizer, mesh))


def learning_rate_schedule(c: ml_collections.ConfigDict):
    """lr as a function of the optimizer update, from the config's rollout-step counts.

    The one place where rollout steps become updates: k = train_batch_prompts /
    mini_batch_prompts updates a rollout step, so the warm-up lasts warmup_rollout_steps x k
    updates (update 0 already at lr / (warmup_rollout_steps x k), the peak reached by the last
    update of rollout step warmup_rollout_steps - 1) and a cosine ends after steps x k.
    """
    updates_per_step = c.train.train_batch_prompts // c.train.mini_batch_prompts
    return train_step.learning_rate_schedule(
        c.optim.lr,
        c.optim.warmup_rollout_steps * updates_per_step,
        c.optim.schedule,
        c.train.steps * updates_per_step,
    )


def make_optimizer(c: ml_collections.ConfigDict):
    """`(optimizer, schedule)` of the config's optim section."""
    schedule = learning_rate_schedule(c)
    optimizer = train_step.make_optimizer(
        schedule,
        weight_decay=c.optim.weight_decay,
        grad_clip=c.optim.grad_clip,
        b1=c.optim.b1,
        b2=c.optim.b2,
        eps=c.optim.eps,
    )
    return optimizer, schedule


def loss_config(c: ml_collections.ConfigDict) -> train_step.LossConfig:
    """The policy loss's knobs: config.loss's keys of the same names, every one of them (the
    record's defaults never stand in for a config; normalize_std belongs to the advantages), None
    meaning L_max for L_const, and the rollout's temperature."""
    names = {f.name for f in dataclasses.fields(train_step.LossConfig)} - {"temperature"}
    return train_step.LossConfig(
        **{
            **{k: c.loss[k] for k in names},
            "norm_const": c.loss.norm_const or c.rollout.max_new_tokens,
            "temperature": c.rollout.temperature,
        }
    )


def update_fns(c: ml_collections.ConfigDict, m: model.Transformer, mesh: Mesh):
    """`(optimizer, train_step, logprobs_fn)`: the compiled update of a mini-batch and the
    log-prob pass of a rollout batch, on packed rows (`dapo_jax.packing`) in micro-batches of
    train.micro_batch_size rows (as many micro-batches as the packing needs)."""
    optimizer, schedule = make_optimizer(c)
    loss_cfg, rows = loss_config(c), c.train.micro_batch_size
    return (
        optimizer,
        train_step.make_train_step(m, optimizer, schedule, loss_cfg, mesh, rows),
        logprobs.make_compute_logprobs(m, mesh, c.rollout.temperature, rows),
    )


def rollout_layout(c: ml_collections.ConfigDict, m: model.Transformer, mesh: Mesh):
    """`(model, mesh, cast)` of the samplers: where the trainer's mesh splits the weights over its
    tensor axis alone (fsdp 1) and `rollout.param_dtype` is theirs, the trainer's model, mesh and
    params as they lie (cast None); else a mesh of data x the trainer's tensor axis (its fsdp
    folded into data: no weight gathered per decoded token) over the same devices and weights in
    `rollout.param_dtype`, cast by one compiled program. `rollout.dtype` sets the samplers'
    compute dtype apart from the trainer's (e.g. a bf16 update, an f32 decode)."""
    dtype = c.rollout.param_dtype or m.config.param_dtype
    config = dataclasses.replace(m.config, param_dtype=dtype, dtype=c.rollout.dtype or m.config.dtype)
    if mesh.shape["fsdp"] == 1 and dtype == m.config.param_dtype:
        return (m if config == m.config else model.Transformer(config)), mesh, None
    rollout_mesh = sharding.make_mesh(
        {"data": -1, "fsdp": 1, "tensor": mesh.shape["tensor"]}, mesh.devices.flat
    )
    rollout_model = model.Transformer(dataclasses.replace(config, remat=None))
    shardings = sharding.param_shardings(m, mesh)
    weight_dtype = rollout_model.config.weight_dtype
    cast = jax.jit(
        lambda p: jax.tree.map(lambda x: x.astype(weight_dtype), p),
        in_shardings=(shardings,),
        out_shardings=shardings,
    )
    return rollout_model, rollout_mesh, cast


def sampling_configs(c: ml_collections.ConfigDict, eos_ids: tuple[int, ...], pad_id: int):
    """`(rollout, eval)` SamplingConfigs: rollout.* and eval.temperature / top_p."""
    common = dict(
        max_new_tokens=c.rollout.max_new_tokens,
        eos_ids=tuple(eos_ids),
        pad_id=pad_id,
        prompt_buckets=tuple(c.data.prompt_buckets),
        top_k=c.rollout.top_k,
        paged=not c.cpu_variants,
    )
    return (
        SamplingConfig(temperature=c.rollout.temperature, top_p=c.rollout.top_p, **common),
        SamplingConfig(temperature=c.eval.temperature, top_p=c.eval.top_p, **common),
    )


def build(
    c: ml_collections.ConfigDict,
    config: model.ModelConfig,
    eos_ids: tuple[int, ...],
    pad_id: int,
    devices=None,
    hbm: float | None = None,
) -> Programs:
    """The meshes over `devices` (default all) and the programs of config `c` for a model of
    `config` (its numerics already the config's), sampling until one of `eos_ids`; the engine
    sized for chips of `hbm` bytes (None: unknown, every row at once)."""
    mesh = sharding.make_mesh(c.mesh, devices)
    m = model.Transformer(config)
    rollout_model, rollout_mesh, cast = rollout_layout(c, m, mesh)
    optimizer, step_fn, logprobs_fn = update_fns(c, m, mesh)
    rollout_sampling, eval_sampling = sampling_configs(c, eos_ids, pad_id)
    held = [abstract_state(m, optimizer, mesh)]  # on a chip beside the engine's pool
    held += [sharding.abstract_sharded_params(rollout_model, rollout_mesh)] if cast is not None else []
    held += [sharding.abstract_sharded_params(m, mesh)] if c.loss.beta > 0 else []
    sampler, eval_sampler = (
        engine_plan.planned_sampler(
            rollout_model, cfg, rollout_mesh, prompts, group, per_chip_bytes(held), hbm
        )
        for cfg, prompts, group in (
            (rollout_sampling, c.filter.gen_batch_prompts, c.rollout.group_size),
            (eval_sampling, c.eval.batch_prompts, c.eval.samples),
        )
    )
    return Programs(
        mesh=mesh,
        rollout_mesh=rollout_mesh,
        model=m,
        rollout_model=rollout_model,
        optimizer=optimizer,
        train_step=step_fn,
        logprobs_fn=logprobs_fn,
        sampler=sampler,
        eval_sampler=eval_sampler,
        cast=cast,
        sizes=program_sizes(c, sampler.micro_batch_prompts, eval_sampler.micro_batch_prompts),
    )


class Lowerable(NamedTuple):
    """A program and its inputs as ShapeDtypeStructs with their shardings: `fn.lower(*args)`."""

    fn: object
    args: tuple
    resident: tuple  # what stays in memory beside the program's arguments, as ShapeDtypeStructs


class ProgramSizes(NamedTuple):
    """The rows and lengths each program is compiled for."""

    train_rows: int  # one optimizer mini-batch: mini_batch_prompts x G
    logprob_rows: int  # one rollout batch: train_batch_prompts x G
    length: int  # T: the longest prompt bucket + L_max, rounded up to the length bucket
    prompt_len: int  # L: the longest prompt bucket
    rollout_prompts: int  # one rollout call: the engine's (engine_plan), or a generation batch
    group: int  # G
    eval_prompts: int  # one eval call: the engine's, or eval.batch_prompts
    eval_samples: int  # n


def program_sizes(
    c: ml_collections.ConfigDict, rollout_call: int | None, eval_call: int | None
) -> ProgramSizes:
    """The sizes of config `c`, a rollout call of `rollout_call` prompts and an eval call of
    `eval_call` (None: a whole generation batch, a whole eval batch)."""
    g, t = c.rollout.group_size, c.train
    longest = max(c.data.prompt_buckets) + c.rollout.max_new_tokens
    bucket = train_step.length_bucket(longest)
    length = -(-longest // bucket) * bucket
    return ProgramSizes(
        train_rows=t.mini_batch_prompts * g,
        logprob_rows=t.train_batch_prompts * g,
        length=length,
        prompt_len=max(c.data.prompt_buckets),
        rollout_prompts=min(rollout_call or c.filter.gen_batch_prompts, c.filter.gen_batch_prompts),
        group=g,
        eval_prompts=min(eval_call or c.eval.batch_prompts, c.eval.batch_prompts),
        eval_samples=c.eval.samples,
    )


def _rows(mesh: Mesh, shape: tuple[int, ...], dtype):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding.batch_sharding(mesh, len(shape)))


def _sampler_inputs(s: Sampler, prompts: int, prompt_len: int, n: int) -> Lowerable:
    """One micro-batch's program as `Sampler.generate` calls it: its prompts filled up to a count
    that splits over the sampler's data x fsdp shards (`sizes.padded_count`)."""
    rep = sharding.replicated(s.mesh)
    prompts = sizes.padded_count(prompts, s.mesh.shape["data"] * s.mesh.shape["fsdp"])
    args = (
        sharding.abstract_sharded_params(s.model, s.mesh),
        jax.ShapeDtypeStruct((prompts, prompt_len), jnp.int32, sharding=rep),
        jax.ShapeDtypeStruct((prompts, prompt_len), bool, sharding=rep),
        jax.ShapeDtypeStruct((prompts,), jnp.int32, sharding=rep),
        jax.ShapeDtypeStruct((), jax.eval_shape(lambda: jax.random.key(0)).dtype, sharding=rep),
    )
    return Lowerable(s.program(n), args, ())


def abstract_inputs(p: Programs, c: ml_collections.ConfigDict) -> dict[str, Lowerable]:
    """Each program with abstract inputs of the config's sizes, and what stays resident beside
    it: the train state (params and AdamW moments) throughout, the reference params (β > 0),
    and during the samplers' programs the rollout weights' copy (their arguments) as well.
    The train step and log-prob pass at their most rows: every response at L_max, one a packed
    row (a packed batch's row count depends on its lengths: `aot.packed_inputs` compiles them
    on a synthetic one at DAPO's lengths)."""
    s = p.sizes
    state = p.abstract_state()
    ref = (sharding.abstract_sharded_params(p.model, p.mesh),) if c.loss.beta > 0 else ()
    moments = (state.opt_state,)
    bt, lt = (s.train_rows, s.length), (s.logprob_rows, s.length)
    batch = train_step.Batch(
        _rows(p.mesh, bt, jnp.int32),
        _rows(p.mesh, bt, jnp.int32),  # segment ids
        _rows(p.mesh, bt, bool),
        _rows(p.mesh, bt, jnp.float32),  # A_i per token
        _rows(p.mesh, bt, jnp.float32),
        _rows(p.mesh, bt, jnp.float32) if c.loss.beta > 0 else None,
        _rows(p.mesh, bt, jnp.float32) if c.loss.rollout_is else None,
    )
    step, logprobs_fn, tokens = p.train_step, p.logprobs_fn, _rows(p.mesh, lt, jnp.int32)
    held = (state,) if p.cast is not None else moments  # beside the samplers' weights
    out = {
        "train": Lowerable(step, (state, batch), ref),
        "logprobs": Lowerable(logprobs_fn, (state.params, tokens, tokens), moments + ref),
        "rollout": _sampler_inputs(p.sampler, s.rollout_prompts, s.prompt_len, s.group)._replace(
            resident=held + ref
        ),
        "eval": _sampler_inputs(p.eval_sampler, s.eval_prompts, s.prompt_len, s.eval_samples)._replace(
            resident=held + ref
        ),
    }
    if p.cast is not None:
        out["cast"] = Lowerable(p.cast, (state.params,), moments + ref)
    return out


def per_chip_bytes(tree) -> float:
    """The bytes one chip holds of a tree of ShapeDtypeStructs with shardings (its largest shard)."""
    total = 0
    for a in jax.tree.leaves(tree):
        shard = a.sharding.shard_shape(a.shape) if a.sharding is not None else a.shape
        total += math.prod(shard) * np.dtype(a.dtype).itemsize
    return float(total)

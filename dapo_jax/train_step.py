"""The compiled DAPO update: train state, AdamW, and one jitted, donated, sharded step.

One optimizer update on a mini-batch of B rows (tokens = prompt + response, padded):
    logits_BxTxV = forward(θ, tokens_BxT);  log pi_θ(o_{i,t}) from logits at t - 1 / temperature
    denom = objective.denominators(loss mask of the WHOLE mini-batch)       (once, before the scan)
    g = sum over micro-batches (lax.scan) of grad_θ policy_loss_sum(micro-batch, denom)
      = grad_θ policy_loss(mini-batch), whatever the number of micro-batches
    θ, opt_state = AdamW(clip_by_global_norm(g)); both kept unchanged if loss or |g| is not finite
Per-token arrays are aligned with tokens_BxT: entry t is about token t (its log-prob is predicted by
the logits at t - 1); entry 0 has no predecessor, is 0 and must be outside the loss mask.
A rollout batch is split into k mini-batches, one update each (`train_on_rollout`); pi_old and
pi_ref log-probs are computed once before the first update by `logprobs.compute_logprobs`.
The trainer's rows are packed rows (`dapo_jax.packing`: several responses with their prompts per
row, segment ids for the mask, A_i per token): the same sums, no padding trained, micro-batches
of `micro_rows` rows. Padded rows (a boolean mask, A_i per row) go through the same functions,
each row one response.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec

from dapo_jax import logprobs, objective, rollout_correction, sharding

# Where log pi_old comes from. "recompute": a forward pass of the current params before the first
# update (verl's recipe). "sampler": the sampler's log-probs (the same params; equal to ~1e-7 in
# float32). "detached": the update's own log-probs under stop_gradient, so r = 1 exactly: only
# for one update per rollout batch, where pi_old is the policy being updated (as TRL and Tunix).
# Without "recompute", `Batch.old_logp_BxT` is the sampler's and the step measures the trainer
# against it (metrics logp_diff_mean / _max), which the first update's params make the check that
# the recompute pass made before.
OLD_LOGP = ("recompute", "sampler", "detached")

SCHEDULES = ("constant", "cosine")  # the learning rate after its warm-up


@dataclasses.dataclass(frozen=True, kw_only=True)
class LossConfig(objective.PolicyLossConfig, rollout_correction.CorrectionConfig):
    """The policy loss's knobs (`objective.PolicyLossConfig`), the mismatch correction's
    (`rollout_correction.CorrectionConfig`, off by default), with where its log-probs come from;
    static under jit, every field set by the config (`programs.loss_config`)."""

    temperature: float  # the rollout temperature; log-probs come from logits / temperature
    old_logp: str = "recompute"  # where log pi_old comes from: one of OLD_LOGP

    def __post_init__(self):
        objective.PolicyLossConfig.__post_init__(self)
        rollout_correction.CorrectionConfig.__post_init__(self)
        if self.old_logp not in OLD_LOGP:
            raise ValueError(f"unknown old_logp {self.old_logp!r}; use one of {OLD_LOGP}")


class TrainState(NamedTuple):
    step: jax.Array  # int32, optimizer updates applied (skipped steps not counted)
    params: Any
    opt_state: optax.OptState


class Rollout(NamedTuple):
    """A rollout batch, B = P x G rows, rows of a group contiguous."""

    tokens_BxT: jax.Array  # int32 prompt + response
    mask_BxT: jax.Array  # bool, real tokens (attention, positions)
    loss_mask_BxT: jax.Array  # bool, response tokens that carry loss: m_{i,t}
    adv_B: jax.Array  # A_i


class Batch(NamedTuple):
    """One optimizer mini-batch: a slice of a `Rollout` plus the log-probs of pi_old and pi_ref."""

    tokens_BxT: jax.Array
    mask_BxT: jax.Array
    loss_mask_BxT: jax.Array
    adv_B: jax.Array
    old_logp_BxT: jax.Array  # log pi_old(o_{i,t}); with LossConfig.old_logp "detached", the sampler's
    ref_logp_BxT: jax.Array | None  # log pi_ref(o_{i,t}); None exactly when β = 0
    is_weight_BxT: jax.Array | None = None  # the correction's IS weights; None unless rollout_is


def learning_rate_schedule(
    peak: float, warmup_updates: int, kind: str, total_updates: int | None = None, final_ratio: float = 0.0
):
    """lr(s) for optimizer update s = 0, 1, ...: linear warm-up peak * (s + 1) / warmup_updates
    (so update 0 already learns), then constant (DAPO) or cosine down to final_ratio * peak at
    total_updates. Counts are updates; `programs.learning_rate_schedule` converts rollout steps."""
    if kind not in SCHEDULES:
        raise ValueError(f"unknown schedule {kind!r}; use one of {SCHEDULES}")
    if warmup_updates < 0:
        raise ValueError(f"warm-up must be >= 0 updates, got {warmup_updates}")
    if kind == "cosine" and (total_updates is None or total_updates <= warmup_updates):
        raise ValueError(
            f"cosine needs total_updates > warmup_updates = {warmup_updates}, got {total_updates}"
        )

    def schedule(step):
        lr = peak * jnp.minimum(1.0, (step + 1.0) / max(warmup_updates, 1))
        if kind == "cosine":
            done = jnp.clip((step - warmup_updates) / (total_updates - warmup_updates), 0.0, 1.0)
            lr = lr * (final_ratio + (1.0 - final_ratio) * 0.5 * (1.0 + jnp.cos(math.pi * done)))
        return lr

    return schedule


def make_optimizer(
    schedule,
    *,
    weight_decay: float,
    grad_clip: float,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
) -> optax.GradientTransformation:
    """Global-norm clipping, then AdamW (decoupled decay on every parameter, as verl's AdamW)."""
    return optax.chain(
        optax.clip_by_global_norm(grad_clip),
        optax.adamw(schedule, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay),
    )


def state_shardings(model, optimizer, mesh) -> TrainState:
    """Shardings of the train state: optimizer moments like their params, counters replicated."""
    param_sh = sharding.param_shardings(model, mesh)
    abstract_opt = jax.eval_shape(optimizer.init, sharding.abstract_params(model))
    opt_sh = optax.tree_map_params(
        optimizer,
        lambda _, sh: sh,
        abstract_opt,
        param_sh,
        transform_non_params=lambda _: sharding.replicated(mesh),
    )
    return TrainState(sharding.replicated(mesh), param_sh, opt_sh)


def init_train_state(model, optimizer, mesh, params) -> TrainState:
    """A train state at step 0 around `params` (laid out as `sharding.param_shardings`)."""
    shardings = state_shardings(model, optimizer, mesh)
    init = lambda p: TrainState(jnp.zeros((), jnp.int32), p, optimizer.init(p))
    with sharding.activate(mesh):
        return jax.jit(init, in_shardings=(shardings.params,), out_shardings=shardings)(params)


def batch_shardings(mesh, with_ref: bool, with_weight: bool = False) -> Batch:
    """Every array's rows over the batch axes, its other axes replicated, whatever its rank (A_i
    is per token on packed rows, per row on padded ones)."""
    rows = sharding.batch_sharding(mesh, 1)
    maybe = lambda on: rows if on else None
    return Batch(rows, rows, rows, rows, rows, maybe(with_ref), maybe(with_weight))


def segments_of(mask_BxT):
    """The segment ids of packed rows (an int `mask_BxT`, `dapo_jax.packing`), None for the
    boolean mask of padded rows (each row one response)."""
    return mask_BxT if jnp.issubdtype(mask_BxT.dtype, jnp.integer) else None


def micro_loss(model, loss_cfg: LossConfig, denom: objective.Denominators, params, micro: Batch):
    """`(loss, metrics)`: a micro-batch's additive share of its mini-batch's policy loss, given the
    mini-batch's `denom`; metrics are its shares too (logp_diff_max its maximum)."""
    c = loss_cfg
    logp_bxT, entropy_bxT = logprobs.model_logp_and_entropy(
        model, params, micro.tokens_BxT, micro.mask_BxT, c.temperature
    )
    detached = c.old_logp == "detached"
    loss, metrics = objective.policy_loss_sum(
        logp_bxT,
        jax.lax.stop_gradient(logp_bxT) if detached else micro.old_logp_BxT,
        micro.adv_B,
        micro.loss_mask_BxT,
        denom,
        c,
        ref_logp_BxT=micro.ref_logp_BxT,
        entropy_BxT=entropy_bxT,
        is_weight_BxT=micro.is_weight_BxT,
        segment_BxT=segments_of(micro.mask_BxT),
    )
    if c.old_logp != "recompute":
        diff = objective.logp_diff(logp_bxT, micro.old_logp_BxT, micro.loss_mask_BxT, denom)
        metrics.update(logp_diff_mean=diff[0], logp_diff_max=diff[1])
    return loss, metrics


def loss_and_grads(model, loss_cfg: LossConfig, params, batch: Batch, num_micro_batches: int, mesh=None):
    """`(grads, metrics)` of the mini-batch's policy loss, accumulated over micro-batches.

    Denominators come from the whole mini-batch's loss mask, so every micro-batch's loss, gradient
    and metrics are its additive share and the scan sums them: 1, 2 or 4 micro-batches give the same
    gradient as one pass. With `mesh`, one that splits only the batch
    (`sharding.splits_only_the_batch`), each device scans its own rows' micro-batches
    (`jax.shard_map`) and one all-reduce sums the devices' gradients, where one program over the
    mesh all-reduces every micro-batch's (on 2 CPU devices a wait for the slower device each time).
    """
    denom = objective.denominators(
        batch.loss_mask_BxT, loss_cfg.agg_mode, loss_cfg.norm_const, segments_of(batch.mask_BxT)
    )
    accumulate = functools.partial(_accumulated_grads, model, loss_cfg, num_micro_batches)
    if mesh is not None:
        accumulate = _summed_over_devices(accumulate, mesh)
    grads, metrics = accumulate(params, batch, denom)
    metrics["loss_tokens"] = denom.tokens
    return grads, metrics


def _accumulated_grads(model, loss_cfg: LossConfig, num_micro_batches: int, params, batch: Batch, denom):
    """The scan of `loss_and_grads` over the micro-batches of `batch`: summed gradients and metrics."""
    grad_fn = jax.value_and_grad(functools.partial(micro_loss, model, loss_cfg, denom), has_aux=True)

    def body(grads, micro):
        (_, metrics), g = grad_fn(params, micro)
        return jax.tree.map(jnp.add, grads, g), metrics

    micros = jax.tree.map(functools.partial(logprobs.split_micro, n=num_micro_batches), batch)
    grads, metrics_N = jax.lax.scan(body, jax.tree.map(jnp.zeros_like, params), micros)
    return grads, {k: jnp.max(v) if k.endswith("_max") else jnp.sum(v) for k, v in metrics_N.items()}


def _summed_over_devices(accumulate, mesh):
    """`accumulate(params, batch, denom)` run by each device of `mesh` on its rows, its gradients
    and metrics summed over the devices (`*_max` metrics: their maximum)."""
    axes = ("data", "fsdp")

    def per_device(params, batch, denom):
        grads, metrics = accumulate(params, batch, denom)
        reduce = lambda k, v: jax.lax.pmax(v, axes) if k.endswith("_max") else jax.lax.psum(v, axes)
        return jax.lax.psum(grads, axes), {k: reduce(k, v) for k, v in metrics.items()}

    return jax.shard_map(
        per_device,
        mesh=mesh,
        in_specs=(PartitionSpec(), PartitionSpec(axes), PartitionSpec()),
        out_specs=PartitionSpec(),
        check_vma=False,
    )


def apply_gradients(optimizer, schedule, state: TrainState, grads, metrics: dict):
    """The AdamW update of `grads`, kept only when the loss and |g| are finite; `metrics` gains
    grad_norm, update_norm, learning_rate and skipped."""
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(metrics["loss"]) & jnp.isfinite(grad_norm)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)
    new_state = TrainState(
        state.step + finite.astype(jnp.int32), keep(params, state.params), keep(opt_state, state.opt_state)
    )
    metrics = dict(
        metrics,
        grad_norm=grad_norm,
        update_norm=jnp.where(finite, optax.tree.norm(updates), 0.0),
        learning_rate=schedule(state.step),
        skipped=1.0 - finite.astype(jnp.float32),
    )
    return new_state, metrics


def _train_step(model, optimizer, schedule, loss_cfg, micro_rows, mesh, state: TrainState, batch: Batch):
    n = logprobs.micro_count(batch.tokens_BxT.shape[0], micro_rows)
    grads, metrics = loss_and_grads(model, loss_cfg, state.params, batch, n, mesh)
    return apply_gradients(optimizer, schedule, state, grads, metrics)


def make_train_step(model, optimizer, schedule, loss_cfg: LossConfig, mesh, micro_rows: int):
    """`train_step(state, batch) -> (state, metrics)`: one jit on `mesh`, the state donated. The
    batch's rows are packed rows (`dapo_jax.packing`: segment ids for its mask, A_i per token)
    or padded rows (a boolean mask, A_i per row), cut into micro-batches of `micro_rows` rows.

    metrics (replicated scalars): loss, pg_loss, pg_clipfrac_upper / _lower / _dual, approx_kl_old,
    kl_ref (β > 0), entropy, token_prob, loss_tokens, logp_diff_mean / _max (unless old_logp is
    "recompute": |log pi_θ - batch.old_logp_BxT| over the loss tokens), grad_norm (before
    clipping), update_norm, learning_rate (of this update), skipped (1.0 when the loss or the
    gradient was not finite: the params and optimizer state are then returned unchanged and
    `state.step` does not advance).
    """
    state_sh = state_shardings(model, optimizer, mesh)
    per_device = sharding.splits_only_the_batch(mesh)  # the gradient of each device's rows apart
    step = functools.partial(
        _train_step, model, optimizer, schedule, loss_cfg, micro_rows, mesh if per_device else None
    )
    batch_sh = batch_shardings(mesh, loss_cfg.beta > 0, bool(loss_cfg.rollout_is))
    jitted = jax.jit(
        step,
        in_shardings=(state_sh, batch_sh),
        out_shardings=(state_sh, sharding.replicated(mesh)),
        donate_argnums=0,
    )
    # a device's own scan has no logical constraints to apply (the mesh is all manual there)
    return jitted if per_device else sharding.on_mesh(jitted, mesh)


# The trained widths a run compiles at most: multiples of its length bucket up to Q + L_max
MAX_WIDTHS = 16
# The finest bucket: a TPU tile of bf16 holds 16 rows, so a finer width pads to it anyway, and
# each width is a compile of the update and the log-prob pass
MIN_BUCKET = 16


def length_bucket(longest: int) -> int:
    """b, the step of the trained widths (`bucket_width`) for rows of at most `longest` = Q + L_max
    tokens (the longest prompt bucket and response): the smallest power of two, at least
    `MIN_BUCKET` (16), with ceil(longest / b) <= `MAX_WIDTHS` (16). At the 32B config's
    2048 + 20480 = 22,528: 22,528 / 16 = 1408, so b = 2048 and the widths are 2048, 4096, ...,
    22,528 (11)."""
    return max(MIN_BUCKET, 1 << (-(-longest // MAX_WIDTHS) - 1).bit_length())


def bucket_width(needed: int, bucket: int, at_most: int) -> int:
    """`needed` columns (at least 1) rounded up to a multiple of `bucket`, at most `at_most`: the
    trained widths, so that few shapes compile."""
    return min(at_most, -(-max(needed, 1) // bucket) * bucket)


@functools.partial(jax.jit, static_argnums=1)
def _mini_batches(batch: Batch, k: int) -> tuple[Batch, ...]:
    """k contiguous slices of `batch`, each laid out over the batch axis of the current mesh."""
    rows = batch.tokens_BxT.shape[0]
    if rows % k:
        raise ValueError(f"rollout of {rows} rows does not split into {k} mini-batches")
    size = rows // k
    take = lambda i, x: nn.with_logical_constraint(
        x[i * size : (i + 1) * size], ("batch",) + (None,) * (x.ndim - 1)
    )
    return tuple(jax.tree.map(functools.partial(take, i), batch) for i in range(k))


def train_on_rollout(
    train_step,
    logprobs_fn,
    mesh,
    state: TrainState,
    rollout: Rollout,
    num_mini_batches: int,
    *,
    ref_params=None,
    old_logp_BxT=None,
    is_weight_BxT=None,
):
    """k = `num_mini_batches` updates on contiguous slices of `rollout` (groups stay whole).

    log pi_old is computed once with the current params before the first update (so the first
    update sees r = 1), unless the caller already did or gives the sampler's (`old_logp_BxT`,
    with LossConfig.old_logp "sampler" or "detached"); log pi_ref with
    `ref_params` only when they are given (exactly when β > 0). `is_weight_BxT`: the mismatch
    correction's weights (`rollout_correction.correct`), with LossConfig.rollout_is only.
    Returns `(state, [metrics of each update])`, metrics left on the device.
    """
    if old_logp_BxT is None:
        old_logp_BxT = logprobs_fn(state.params, rollout.tokens_BxT, rollout.mask_BxT)
    ref_logp_BxT = (
        None if ref_params is None else logprobs_fn(ref_params, rollout.tokens_BxT, rollout.mask_BxT)
    )
    with sharding.activate(mesh):
        minis = _mini_batches(Batch(*rollout, old_logp_BxT, ref_logp_BxT, is_weight_BxT), num_mini_batches)
    metrics = []
    for mini in minis:
        state, m = train_step(state, mini)
        metrics.append(m)
    return state, metrics

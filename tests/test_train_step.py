"""The compiled step: accumulation invariance, sharded == single device, NaN guard, k updates."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dapo_jax import logprobs, model, objective, packing, sharding
from dapo_jax import train_step as ts

CFG = model.ModelConfig(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    dtype="float32",
)
MODEL = model.Transformer(CFG)
FAST_COMPILE = {"xla_backend_optimization_level": 0}  # the tests' own jits: ~40% less compile time
forward = jax.jit(functools.partial(model.forward, MODEL), compiler_options=FAST_COMPILE)


def loss_cfg(agg_mode="token-mean"):
    return ts.LossConfig(
        eps_low=0.2,
        eps_high=0.28,
        clip_ratio_c=3.0,
        agg_mode=agg_mode,
        norm_const=16.0,
        beta=0.1,
        entropy_coef=0.0,
        temperature=0.7,
    )


def single_mesh():
    return sharding.make_mesh({"data": -1}, devices=jax.devices()[:1])


def rollout(rows=8, length=16, seed=0):
    """Left-padded prompts of 3-5 tokens, responses of 1 to 11 tokens, then right padding."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, CFG.vocab_size, (rows, length)).astype(np.int32)
    prompt_end = 5
    prompt_len = rng.integers(3, 6, rows)
    response_len = np.resize([1, 11, 2, 9, 3, 10, 1, 6], rows)
    pos = np.arange(length)[None]
    mask = (pos >= prompt_end - prompt_len[:, None]) & (pos < prompt_end + response_len[:, None])
    loss_mask = mask & (pos >= prompt_end)
    adv = rng.choice([-1.5, -0.5, 0.5, 1.5], rows)
    return ts.Rollout(np.where(mask, tokens, 0), mask, loss_mask, adv)


@functools.cache
def init(mesh, seed=0):
    return sharding.init_params(MODEL, mesh, jax.random.key(seed))


@functools.cache
def single_device_batch():
    """A mini-batch (on the host) for `init(single_mesh())` whose old and reference log-probs are
    the policy's plus noise, so that the clips are hit."""
    r = rollout()
    logp = jax.jit(
        functools.partial(logprobs.compute_logprobs, MODEL, temperature=0.7),
        compiler_options=FAST_COMPILE,
    )(init(single_mesh()), r.tokens_BxT, r.mask_BxT)
    old_noise, ref_noise = np.random.default_rng(1).normal(0, 0.3, (2, *logp.shape))
    return jax.device_get(ts.Batch(*r, logp + old_noise, logp + ref_noise))


# token-mean in the fast tier; the other modes' micro-batch shares are pinned by hand in
# test_objective.py, their compiled accumulation here in the full suite.
@pytest.mark.parametrize(
    "agg_mode",
    [m if m == "token-mean" else pytest.param(m, marks=pytest.mark.slow) for m in objective.AGG_MODES],
)
def test_gradient_accumulation_is_invariant(agg_mode):
    params = init(single_mesh())
    batch = single_device_batch()
    grads_of = jax.jit(
        functools.partial(ts.loss_and_grads, MODEL, loss_cfg(agg_mode)),
        static_argnums=2,
        compiler_options=FAST_COMPILE,
    )
    g1, m1 = grads_of(params, batch, 1)
    assert m1["pg_clipfrac_upper"] > 0 and m1["pg_clipfrac_lower"] > 0  # the clips are exercised
    flat1 = np.concatenate([np.ravel(x) for x in jax.tree.leaves(g1)])
    for n in (2, 4):
        gn, mn = grads_of(params, batch, n)
        flat = np.concatenate([np.ravel(x) for x in jax.tree.leaves(gn)])
        np.testing.assert_allclose(flat, flat1, rtol=0, atol=1e-5 * np.abs(flat1).max())
        for k in m1:
            np.testing.assert_allclose(mn[k], m1[k], rtol=1e-5, atol=1e-7)
    # The loss of the whole mini-batch, computed in one plain pass without the step's machinery.
    logits = forward(params, batch.tokens_BxT, batch.mask_BxT)
    logp = jax.nn.log_softmax(logits / 0.7)[:, :-1]
    logp = np.take_along_axis(np.asarray(logp), batch.tokens_BxT[:, 1:, None], -1)[..., 0]
    loss, _ = objective.policy_loss(
        logp,
        batch.old_logp_BxT[:, 1:],
        batch.adv_B,
        batch.loss_mask_BxT[:, 1:],
        objective.PolicyLossConfig(clip_ratio_c=3.0, agg_mode=agg_mode, norm_const=16.0, beta=0.1),
        ref_logp_BxT=batch.ref_logp_BxT[:, 1:],
    )
    np.testing.assert_allclose(m1["loss"], loss, rtol=1e-5)


def test_correction_weights_reach_every_micro_batch():
    # IS weights in the batch split like its rows: 1 and 2 micro-batches give the pg_loss of the
    # whole mini-batch weighted by them (objective.policy_loss on the step's own log-probs).
    params = init(single_mesh())
    batch = single_device_batch()
    weight = np.random.default_rng(3).uniform(0.0, 2.0, batch.loss_mask_BxT.shape).astype(np.float32)
    cfg = dataclasses.replace(loss_cfg(), rollout_is="token")
    grads_of = jax.jit(
        functools.partial(ts.loss_and_grads, MODEL, cfg), static_argnums=2, compiler_options=FAST_COMPILE
    )
    _, m1 = grads_of(params, batch._replace(is_weight_BxT=weight), 1)
    _, m2 = grads_of(params, batch._replace(is_weight_BxT=weight), 2)
    logp = jax.jit(
        functools.partial(logprobs.compute_logprobs, MODEL, temperature=0.7),
        compiler_options=FAST_COMPILE,
    )(params, batch.tokens_BxT, batch.mask_BxT)
    args = (logp, batch.old_logp_BxT, batch.adv_B, batch.loss_mask_BxT, cfg)
    _, want = objective.policy_loss(*args, ref_logp_BxT=batch.ref_logp_BxT, is_weight_BxT=weight)
    _, unweighted = objective.policy_loss(*args, ref_logp_BxT=batch.ref_logp_BxT)
    assert abs(want["pg_loss"] - unweighted["pg_loss"]) > 1e-3  # the weights matter here
    np.testing.assert_allclose(m1["pg_loss"], want["pg_loss"], rtol=1e-5)
    np.testing.assert_allclose(m2["pg_loss"], want["pg_loss"], rtol=1e-5)


def test_detached_old_logp_is_the_recomputed_one_and_measures_the_sampler():
    # One update per rollout: pi_old = pi_theta, so "detached" (r = 1 under stop_gradient) must
    # give the gradient of "recompute" with the recomputed log-probs, and reports its distance to
    # the given (sampler's) log-probs: here the recomputed ones plus a known offset per token.
    params = init(single_mesh())
    batch = single_device_batch()
    r = rollout()
    logprobs_fn = functools.partial(logprobs.compute_logprobs, MODEL, temperature=0.7)
    logp = np.asarray(jax.jit(logprobs_fn, compiler_options=FAST_COMPILE)(params, r.tokens_BxT, r.mask_BxT))
    offset = np.random.default_rng(5).uniform(-0.5, 0.5, logp.shape).astype(np.float32)
    grads_of = lambda mode, old, n: jax.jit(
        functools.partial(ts.loss_and_grads, MODEL, dataclasses.replace(loss_cfg(), old_logp=mode)),
        static_argnums=2,
        compiler_options=FAST_COMPILE,
    )(params, batch._replace(old_logp_BxT=old), n)
    g_ref, m_ref = grads_of("recompute", logp, 1)
    assert "logp_diff_mean" not in m_ref and abs(m_ref["approx_kl_old"]) < 1e-6
    g_det, m_det = grads_of("detached", logp + offset, 2)
    flat = lambda g: np.concatenate([np.ravel(x) for x in jax.tree.leaves(g)])
    np.testing.assert_allclose(flat(g_det), flat(g_ref), rtol=0, atol=1e-5 * np.abs(flat(g_ref)).max())
    assert m_det["approx_kl_old"] == 0.0 and m_det["pg_clipfrac_upper"] == 0.0
    on = np.asarray(r.loss_mask_BxT)
    np.testing.assert_allclose(m_det["logp_diff_mean"], np.abs(offset[on]).mean(), rtol=1e-4)
    np.testing.assert_allclose(m_det["logp_diff_max"], np.abs(offset[on]).max(), rtol=1e-4)


@functools.cache  # one compilation per setting, shared by the tests
def make_step(mesh, micro_rows=4):
    """Micro-batches of `micro_rows` rows (two of `single_device_batch`'s padded ones)."""
    # eps = 1 makes Adam's first update ~ lr * g / (|g| + 1): smooth in g, so that float noise
    # in a near-zero gradient cannot flip the sign of an update as g / |g| would.
    schedule = ts.learning_rate_schedule(0.1, 0, "constant")
    opt = ts.make_optimizer(schedule, weight_decay=0.1, grad_clip=1e3, eps=1.0)
    return opt, ts.make_train_step(MODEL, opt, schedule, loss_cfg(), mesh, micro_rows)


@pytest.mark.slow
@pytest.mark.parametrize("axes", [{"data": 2, "fsdp": 2, "tensor": 2}, {"data": 4}])
def test_sharded_step_equals_single_device(axes):
    """Weights sharded (one program over the mesh) or whole on each of 4 data devices (each
    device's gradient apart, `jax.shard_map`, then summed): the single device's update."""
    single = single_mesh()
    params0 = init(single)
    batch = single_device_batch()  # on the host, as the loop sends it
    expected0 = jax.tree.map(np.asarray, params0)

    opt, step = make_step(single)
    state1, m1 = step(ts.init_train_state(MODEL, opt, single, params0), batch)

    mesh = sharding.make_mesh(axes, devices=jax.devices()[: np.prod(list(axes.values()))])
    params8 = jax.device_put(expected0, sharding.param_shardings(MODEL, mesh))
    opt8, step8 = make_step(mesh)
    state8 = ts.init_train_state(MODEL, opt8, mesh, params8)
    per_device = "manual_computation" in step8.lower(state8, batch).as_text()
    assert per_device == (len(axes) == 1)
    state8, m8 = step8(state8, batch)

    kernel = state8.params["layers_0"]["mlp"]["gate_proj"]["kernel"]
    assert kernel.sharding.spec == jax.sharding.PartitionSpec("fsdp", "tensor")
    assert kernel.sharding.is_fully_replicated == per_device
    mu = state8.opt_state[1][0].mu["layers_0"]["mlp"]["gate_proj"]["kernel"]
    assert mu.sharding.spec == kernel.sharding.spec
    for k in ("loss", "grad_norm", "update_norm", "pg_clipfrac_upper", "entropy", "kl_ref"):
        np.testing.assert_allclose(m8[k], m1[k], rtol=1e-5)
    moved = 0.0
    for a, b, p0 in zip(
        jax.tree.leaves(state8.params), jax.tree.leaves(state1.params), jax.tree.leaves(expected0)
    ):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)
        moved = max(moved, float(np.max(np.abs(np.asarray(b) - p0))))
    assert moved > 1e-3  # the step did change the parameters


@pytest.mark.slow
@pytest.mark.parametrize(
    "axes, chunk",
    [({"data": 2, "fsdp": 2, "tensor": 2}, 0), ({"data": 2}, 0), ({"data": 2, "fsdp": 2, "tensor": 2}, 4)],
)
def test_packed_sharded_step_and_logprobs_equal_the_padded_single_device_ones(axes, chunk, attention_blocks):
    # The mini-batch packed (dapo_jax.packing) into rows split over a sharded mesh, against the
    # padded rows' scan on one device: the same update and, unpacked, the same log-probs. The
    # packed rows' attention: the dense segment mask, or blocks of 4 (`blocked_attention`).
    single = single_mesh()
    params0 = init(single)
    batch = single_device_batch()
    opt, step = make_step(single)
    state1, m1 = step(ts.init_train_state(MODEL, opt, single, params0), batch)

    d = axes["data"] * axes.get("fsdp", 1)  # micro-batches of d packed rows, one on each shard
    p = packing.plan(batch.mask_BxT, 1, rows_multiple=d)
    packed = ts.Batch(
        *packing.pack_rows(p, batch.tokens_BxT, batch.loss_mask_BxT, batch.adv_B),
        packing.pack(p, batch.old_logp_BxT),
        packing.pack(p, batch.ref_logp_BxT),
    )
    mesh = sharding.make_mesh(axes, devices=jax.devices()[: np.prod(list(axes.values()))])
    params8 = jax.device_put(jax.tree.map(np.asarray, params0), sharding.param_shardings(MODEL, mesh))
    attention_blocks(chunk)
    opt8, packed_step = make_step(mesh, micro_rows=d)
    state8, m8 = packed_step(ts.init_train_state(MODEL, opt8, mesh, params8), packed)
    assert set(m8) == set(m1)
    for k in m1:
        np.testing.assert_allclose(m8[k], m1[k], rtol=1e-5, atol=1e-7, err_msg=k)
    for a, b in zip(jax.tree.leaves(state8), jax.tree.leaves(state1)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)
    r = rollout()
    logp = logprobs.make_compute_logprobs(MODEL, mesh, 0.7, d)(params8, packed.tokens_BxT, packed.mask_BxT)
    full = logprobs.make_compute_logprobs(MODEL, single, 0.7, 8)(params0, r.tokens_BxT, r.mask_BxT)
    on = np.asarray(r.loss_mask_BxT)
    np.testing.assert_allclose(
        packing.unpack(p, np.asarray(logp))[on], np.asarray(full)[on], rtol=1e-5, atol=1e-6
    )


@pytest.mark.slow
def test_non_finite_loss_skips_the_update():
    mesh = single_mesh()
    params = init(mesh)
    batch = single_device_batch()
    opt, step = make_step(mesh)
    state = ts.init_train_state(MODEL, opt, mesh, params)
    before = jax.tree.map(np.asarray, state)
    bad_old = np.asarray(batch.old_logp_BxT).copy()
    bad_old[np.nonzero(batch.loss_mask_BxT)[0][0], np.nonzero(batch.loss_mask_BxT)[1][0]] = np.nan
    state, metrics = step(state, batch._replace(old_logp_BxT=bad_old))
    assert metrics["skipped"] == 1.0 and np.isnan(metrics["loss"])
    assert int(state.step) == 0
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(before)):
        np.testing.assert_array_equal(np.asarray(a), b)
    # The state is intact: the next, finite batch updates it.
    state, metrics = step(state, batch)
    assert metrics["skipped"] == 0.0 and int(state.step) == 1
    np.testing.assert_allclose(metrics["learning_rate"], 0.1)
    assert not np.array_equal(np.asarray(state.params["norm"]["scale"]), before.params["norm"]["scale"])


@pytest.mark.slow
def test_old_logprobs_are_the_policy_before_the_first_of_k_updates():
    mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    opt, step = make_step(mesh)
    state = ts.init_train_state(MODEL, opt, mesh, init(mesh))
    logprobs_fn = logprobs.make_compute_logprobs(MODEL, mesh, 0.7, 8)  # 2 micro-batches of 8
    r = rollout(rows=16, seed=3)
    state, metrics = ts.train_on_rollout(step, logprobs_fn, mesh, state, r, 2, ref_params=init(mesh))
    first, second = jax.device_get(metrics)
    assert int(state.step) == 2
    # Update 1: pi_theta = pi_old = pi_ref, so r = 1 on every token, no clipping, no KL.
    assert abs(first["approx_kl_old"]) < 1e-6 and abs(first["kl_ref"]) < 1e-6
    for k in ("pg_clipfrac_upper", "pg_clipfrac_lower", "pg_clipfrac_dual"):
        assert first[k] == 0.0
    # Update 2 is scored against the same pi_old (computed once), which update 1 moved away from.
    assert second["approx_kl_old"] > 1e-4 and second["kl_ref"] > 1e-4


def test_optimizer_clips_the_global_norm_then_applies_adamw():
    # g = (3, 4) has norm 5. lr 1, eps 1, weight decay 0.1, first Adam step: m_hat = g, v_hat = g^2,
    # update = -(g / (|g| + 1) + 0.1 p).
    params = {"w": jnp.array([1.0, 2.0])}
    grads = {"w": jnp.array([3.0, 4.0])}
    schedule = ts.learning_rate_schedule(1.0, 0, "constant")
    for max_norm, g in ((1.0, np.array([0.6, 0.8])), (10.0, np.array([3.0, 4.0]))):
        opt = ts.make_optimizer(schedule, weight_decay=0.1, grad_clip=max_norm, eps=1.0)
        updates, _ = opt.update(grads, opt.init(params), params)
        np.testing.assert_allclose(updates["w"], -(g / (g + 1) + 0.1 * np.array([1.0, 2.0])), rtol=1e-5)


def test_learning_rate_schedules_by_hand():
    constant = ts.learning_rate_schedule(1e-3, 4, "constant")
    np.testing.assert_allclose(
        [constant(s) for s in range(6)], [2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3, 1e-3], rtol=1e-6
    )
    cosine = ts.learning_rate_schedule(1.0, 2, "cosine", total_updates=6, final_ratio=0.0)
    np.testing.assert_allclose(
        [cosine(s) for s in range(7)],
        [0.5, 1, 1, 0.5 * (1 + np.cos(np.pi / 4)), 0.5, 0.5 * (1 + np.cos(3 * np.pi / 4)), 0],
        rtol=1e-6,
        atol=1e-7,
    )
    with pytest.raises(ValueError, match="total_updates"):
        ts.learning_rate_schedule(1.0, 2, "cosine")

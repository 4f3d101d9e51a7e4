"""Hand-computed checks of the objective: advantages, clip, dual clip, aggregation, KL, entropy."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dapo_jax import objective

EPS = 1e-6  # the advantage's std epsilon


def test_group_advantages_by_hand():
    # Group 1: mean -0.5, deviations (1.5, -.5, -.5, -.5), unbiased var (2.25 + 3 * .25) / 3 = 1.
    # Group 2: constant rewards, every advantage 0.
    rewards = np.array([1.0, -1.0, -1.0, -1.0, 2.0, 2.0, 2.0, 2.0])
    adv = objective.group_advantages(rewards, 4)
    np.testing.assert_allclose(adv, np.array([1.5, -0.5, -0.5, -0.5, 0, 0, 0, 0]) / (1 + EPS), rtol=1e-6)
    # Unbiased std: group (0, 1) has std sqrt(0.5), not the population 0.5.
    np.testing.assert_allclose(
        objective.group_advantages(jnp.array([0.0, 1.0]), 2),
        np.array([-0.5, 0.5]) / (math.sqrt(0.5) + EPS),
        rtol=1e-6,
    )
    # Dr.GRPO: R - mean, no std.
    np.testing.assert_allclose(
        objective.group_advantages(rewards, 4, normalize_std=False), [1.5, -0.5, -0.5, -0.5, 0, 0, 0, 0]
    )


def test_group_of_one_has_mean_zero_std_one():
    np.testing.assert_allclose(
        objective.group_advantages(np.array([3.0, -1.0]), 1), np.array([3.0, -1.0]) / (1 + EPS), rtol=1e-7
    )
    np.testing.assert_allclose(
        objective.group_advantages(np.array([3.0, -1.0]), 1, normalize_std=False), [3.0, -1.0]
    )
    with pytest.raises(ValueError, match="not groups of 4"):
        objective.group_advantages(np.zeros(6), 4)


# Ratios r per token and advantages per row; old_logp = 0 so logp = log r.
RATIO = np.array(
    [
        [0.5, 1.0, 1.2, 1.5],  # A = +1: r = 1.5 is above 1 + ε_high = 1.28
        [0.5, 1.0, 1.5, 20.0],
    ]
)  # A = -1: r = 0.5 below 1 - ε_low, r = 20 above c = 10
ADV = np.array([1.0, -1.0])


def _clip_loss(clip_ratio_c):
    mask = np.ones_like(RATIO, bool)
    cfg = objective.PolicyLossConfig(eps_low=0.2, eps_high=0.28, clip_ratio_c=clip_ratio_c)
    fn = lambda logp: objective.policy_loss(logp, jnp.zeros_like(logp), ADV, mask, cfg)
    value_and_grad = jax.jit(jax.value_and_grad(fn, has_aux=True))
    (loss, metrics), grad = value_and_grad(jnp.log(jnp.asarray(RATIO)))
    return loss, metrics, np.asarray(grad)


def test_clip_higher_and_dual_clip_values_and_zero_gradients():
    loss, metrics, grad = _clip_loss(10.0)
    # A = +1: l = max(-r, -clip(r, .8, 1.28)) = -.5, -1, -1.2, -1.28 (clipped).
    # A = -1: l = max(r, clip(r)) = .8 (clipped), 1, 1.5, then min(20, c = 10) = 10 (dual clip).
    np.testing.assert_allclose(loss, (-0.5 - 1 - 1.2 - 1.28 + 0.8 + 1 + 1.5 + 10) / 8, rtol=1e-6)
    np.testing.assert_allclose(metrics["pg_loss"], loss)
    # dl/dlogp = dl/dr * r: -A r where the unclipped branch is active, 0 where a clip is.
    np.testing.assert_allclose(
        grad, np.array([[-0.5, -1, -1.2, 0], [0, 1, 1.5, 0]]) / 8, rtol=1e-5, atol=1e-8
    )
    np.testing.assert_allclose(metrics["pg_clipfrac_upper"], 1 / 8)
    np.testing.assert_allclose(metrics["pg_clipfrac_lower"], 1 / 8)
    np.testing.assert_allclose(metrics["pg_clipfrac_dual"], 1 / 8)


def test_without_dual_clip_a_large_ratio_keeps_its_gradient():
    loss, metrics, grad = _clip_loss(None)
    np.testing.assert_allclose(loss, (-0.5 - 1 - 1.2 - 1.28 + 0.8 + 1 + 1.5 + 20) / 8, rtol=1e-6)
    np.testing.assert_allclose(grad[1], np.array([0, 1, 1.5, 20]) / 8, rtol=1e-5)
    assert metrics["pg_clipfrac_dual"] == 0
    with pytest.raises(ValueError, match="must be > 1"):
        objective.PolicyLossConfig(clip_ratio_c=0.5)


def test_approx_kl_to_old_and_token_prob():
    # r = e on one token: k3 of KL(pi_old || pi_theta) = r - 1 - log r = e - 2; r = 1 gives 0.
    logp = jnp.array([[-1.0, -2.0]])
    old = jnp.array([[-2.0, -2.0]])
    _, metrics = objective.policy_loss(logp, old, np.zeros(1), np.ones((1, 2), bool))
    np.testing.assert_allclose(metrics["approx_kl_old"], (math.e - 2) / 2, rtol=1e-6)
    np.testing.assert_allclose(metrics["token_prob"], (math.exp(-1) + math.exp(-2)) / 2, rtol=1e-6)


# Row 0: A = 2, one token; row 1: A = -1, three tokens; row 2: masked out entirely. Ratio 1, so
# l = -A on every token: -2 on row 0, +1 on row 1. Masked slots hold NaN, which must not count.
AGG_ADV = np.array([2.0, -1.0, 5.0])
AGG_MASK = np.array([[1, 0, 0, 0], [1, 1, 1, 0], [0, 0, 0, 0]], bool)


@pytest.mark.parametrize(
    "agg_mode, norm_const, loss, row0, row1",
    [
        ("token-mean", None, (-2 + 3) / 4, -2 / 4, 1 / 4),
        ("seq-mean-token-mean", None, (-2 / 1 + 3 / 3) / 2, -2 / (1 * 2), 1 / (3 * 2)),
        ("seq-mean-token-sum", None, (-2 + 3) / 2, -2 / 2, 1 / 2),
        ("seq-mean-token-sum-norm", 4.0, (-2 + 3) / (2 * 4), -2 / (2 * 4), 1 / (2 * 4)),
    ],
)
def test_aggregation_modes_by_hand(agg_mode, norm_const, loss, row0, row1):
    old = np.where(AGG_MASK, -1.0, np.nan)
    cfg = objective.PolicyLossConfig(agg_mode=agg_mode, norm_const=norm_const, beta=0.1)
    fn = lambda logp: objective.policy_loss(logp, old, AGG_ADV, AGG_MASK, cfg, ref_logp_BxT=old)
    (value, _), grad = jax.jit(jax.value_and_grad(fn, has_aux=True))(jnp.full((3, 4), -1.0))
    np.testing.assert_allclose(value, loss, rtol=1e-6)
    expected = np.zeros((3, 4))
    expected[0, 0] = row0
    expected[1, :3] = row1
    np.testing.assert_allclose(grad, expected, rtol=1e-6)


def test_unknown_agg_mode_and_missing_norm_const_are_errors():
    args = (jnp.zeros((1, 2)), jnp.zeros((1, 2)), np.ones(1), np.ones((1, 2)))
    with pytest.raises(ValueError, match="valid modes are.*token-mean.*seq-mean-token-sum-norm"):
        objective.PolicyLossConfig(agg_mode="seq-sum")
    with pytest.raises(ValueError, match="needs norm_const"):
        objective.policy_loss(*args, objective.PolicyLossConfig(agg_mode="seq-mean-token-sum-norm"))


def _worked_example_grad(lengths, agg_mode, norm_const=None):
    """|d loss / d logp| on every response token of a group of four (A = +1, +1, -1, -1), the
    aggregation of docs/dapo_spec.md section 3."""
    mask = np.arange(max(lengths))[None, :] < np.array(lengths)[:, None]
    adv = np.array([1.0, 1.0, -1.0, -1.0])
    logp = jnp.full(mask.shape, -1.0)
    cfg = objective.PolicyLossConfig(agg_mode=agg_mode, norm_const=norm_const, clip_ratio_c=10.0)
    fn = lambda lp: objective.policy_loss(lp, logp, adv, mask, cfg)[0]
    grad = np.asarray(jax.jit(jax.grad(fn))(logp))
    np.testing.assert_array_equal(grad[~mask], 0)
    # The sign is -A: a correct answer's tokens are pushed up, a wrong one's down.
    np.testing.assert_array_equal(np.sign(grad[mask]), -np.repeat(adv, lengths))
    return [np.abs(grad[i, :n]) for i, n in enumerate(lengths)]


def test_worked_example_token_mean_couples_the_batch():
    for lengths, weight in (((50, 500, 50, 500), 1 / 1100), ((50, 500, 50, 4000), 1 / 4600)):
        for row in _worked_example_grad(lengths, "token-mean"):
            np.testing.assert_allclose(row, weight, rtol=1e-5)


def test_worked_example_seq_mean_and_dr_grpo_do_not():
    for lengths in ((50, 500, 50, 500), (50, 500, 50, 4000)):
        rows = _worked_example_grad(lengths, "seq-mean-token-mean")
        np.testing.assert_allclose(rows[0], 0.005, rtol=1e-5)  # 1 / (4 * 50)
        np.testing.assert_allclose(rows[3], 1 / (4 * lengths[3]), rtol=1e-5)
        for row in _worked_example_grad(lengths, "seq-mean-token-sum-norm", 4096.0):
            np.testing.assert_allclose(row, 1 / (4 * 4096), rtol=1e-5)


def test_k3_kl_to_reference_by_hand():
    # Token 0: ref - logp = ln 2, KL = 2 - ln 2 - 1; token 1: ref = logp, KL = 0. A = 0: no pg term.
    logp = jnp.zeros((1, 2))
    ref = jnp.array([[math.log(2.0), 0.0]])
    kl0 = 1 - math.log(2.0)
    np.testing.assert_allclose(objective.k3_kl(logp, ref), [[kl0, 0.0]], rtol=1e-6)
    cfg = objective.PolicyLossConfig(beta=0.5)
    fn = lambda lp: objective.policy_loss(
        lp, jnp.zeros((1, 2)), np.zeros(1), np.ones((1, 2)), cfg, ref_logp_BxT=ref
    )
    (loss, metrics), grad = jax.jit(jax.value_and_grad(fn, has_aux=True))(logp)
    np.testing.assert_allclose(loss, 0.5 * kl0 / 2, rtol=1e-6)
    np.testing.assert_allclose(metrics["kl_ref"], kl0 / 2, rtol=1e-6)
    # d KL / d logp = 1 - exp(ref - logp) = -1 on token 0, 0 on token 1; times β / 2 tokens.
    np.testing.assert_allclose(grad, [[-0.25, 0.0]], atol=1e-7)
    with pytest.raises(ValueError, match="needs ref_logp"):
        objective.policy_loss(logp, logp, np.zeros(1), np.ones((1, 2)), cfg)


def test_k3_kl_is_clamped_at_ten_like_the_recipe():
    # ref - logp = 3: e^3 - 3 - 1 = 16.09 -> 10, with no gradient; ref - logp = 2: 3.389, kept.
    logp = jnp.zeros((1, 2))
    ref = jnp.array([[3.0, 2.0]])
    np.testing.assert_allclose(objective.k3_kl(logp, ref), [[10.0, math.exp(2) - 3]], rtol=1e-6)
    grad = jax.grad(lambda lp: objective.k3_kl(lp, ref).sum())(logp)
    np.testing.assert_allclose(grad, [[0.0, 1 - math.exp(2)]], rtol=1e-6)


def test_token_logp_and_entropy_by_hand():
    # Row 0: uniform over 4 (H = ln 4).
    # Row 1: logits (0, 2 ln 3) at temperature 2 give p = (1/4, 3/4).
    logits = jnp.array([[[0.0, 0.0, 0.0, 0.0]], [[0.0, 2 * math.log(3.0), -1e9, -1e9]]])
    logp, entropy = objective.token_logp_and_entropy(logits, jnp.array([[2], [1]]), 2.0)
    np.testing.assert_allclose(logp, [[-math.log(4)], [math.log(0.75)]], rtol=1e-6)
    h1 = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    np.testing.assert_allclose(entropy, [[math.log(4)], [h1]], rtol=1e-6)


def test_entropy_bonus_enters_the_loss():
    entropy = jnp.array([[1.0, 3.0]])
    cfg = objective.PolicyLossConfig(entropy_coef=0.1)
    fn = lambda h: objective.policy_loss(
        jnp.zeros((1, 2)), jnp.zeros((1, 2)), np.zeros(1), np.ones((1, 2)), cfg, entropy_BxT=h
    )
    (loss, metrics), grad = jax.jit(jax.value_and_grad(fn, has_aux=True))(entropy)
    np.testing.assert_allclose(metrics["entropy"], 2.0)
    np.testing.assert_allclose(loss, -0.1 * 2.0, rtol=1e-6)
    np.testing.assert_allclose(grad, [[-0.05, -0.05]], rtol=1e-6)


@pytest.mark.parametrize("agg_mode", objective.AGG_MODES)
def test_micro_batch_shares_add_up_to_the_mini_batch_loss(agg_mode):
    rng = np.random.default_rng(0)
    lengths = np.array([1, 7, 2, 8, 3, 6])
    mask = np.arange(8)[None] < lengths[:, None]
    logp, old = rng.normal(-2, 0.3, (2, 6, 8))
    adv = rng.normal(size=6)
    cfg = objective.PolicyLossConfig(clip_ratio_c=3.0, agg_mode=agg_mode, norm_const=8.0)
    whole, whole_metrics = objective.policy_loss(logp, old, adv, mask, cfg)
    denom = objective.denominators(mask, agg_mode, 8.0)
    parts = [
        objective.policy_loss_sum(logp[s], old[s], adv[s], mask[s], denom, cfg)
        for s in (slice(0, 2), slice(2, 6))
    ]
    np.testing.assert_allclose(parts[0][0] + parts[1][0], whole, rtol=1e-6)
    for k, v in whole_metrics.items():
        np.testing.assert_allclose(parts[0][1][k] + parts[1][1][k], v, rtol=1e-6, atol=1e-7)
    # Normalising each part by its own denominator (verl #5625) gives a different loss here.
    own = [
        objective.policy_loss(logp[s], old[s], adv[s], mask[s], cfg)[0] for s in (slice(0, 2), slice(2, 6))
    ]
    assert abs((own[0] + own[1]) / 2 - whole) > 1e-3

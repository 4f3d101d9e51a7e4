"""The mismatch correction's modes against hand computations, and the weights in the loss."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dapo_jax import objective
from dapo_jax import rollout_correction as rc

# log rho = log pi_old - log pi_sampler per token; the last token of row 1 is outside the mask.
RHO = np.array([[1.0, 3.0, 0.25, 1.0], [1.5, 1.2, 1.0, 7.0]])
MASK = np.array([[True, True, True, True], [True, True, True, False]])
SAMPLER = np.full(RHO.shape, -1.0)
OLD = SAMPLER + np.log(RHO)


def _correct(**kw):
    return rc.correct(rc.CorrectionConfig(**kw), jnp.asarray(OLD), jnp.asarray(SAMPLER), MASK)


def test_token_truncated_importance_sampling():
    corr = _correct(rollout_is="token", rollout_is_threshold=2.0)
    want = np.array([[1.0, 2.0, 0.25, 1.0], [1.5, 1.2, 1.0, 0.0]])  # min(rho, 2), 0 off the mask
    np.testing.assert_allclose(corr.is_weight_BxT, want, rtol=1e-6)
    np.testing.assert_array_equal(corr.loss_mask_BxT, MASK)
    m = corr.metrics
    np.testing.assert_allclose(m["rollout_corr/rollout_is_mean"], want.sum() / 7, rtol=1e-6)
    np.testing.assert_allclose(m["rollout_corr/rollout_is_max"], 3.0, rtol=1e-6)
    np.testing.assert_allclose(m["rollout_corr/rollout_is_ratio_fraction_high"], 1 / 7, rtol=1e-6)
    np.testing.assert_allclose(m["rollout_corr/rollout_rs_masked_fraction"], 0.0)
    logs = np.log(RHO[MASK])
    np.testing.assert_allclose(m["rollout_corr/kl"], -logs.mean(), rtol=1e-5)
    np.testing.assert_allclose(m["rollout_corr/k3_kl"], (np.exp(logs) - 1 - logs).mean(), rtol=1e-5)


def test_sequence_importance_sampling():
    corr = _correct(rollout_is="sequence", rollout_is_threshold=2.0)
    # row 0: 1 * 3 * 0.25 * 1 = 0.75; row 1: 1.5 * 1.2 * 1 = 1.8 (the 7 is off the mask)
    want = np.array([[0.75] * 4, [1.8, 1.8, 1.8, 0.0]])
    np.testing.assert_allclose(corr.is_weight_BxT, want, rtol=1e-5)
    corr = _correct(rollout_is="sequence", rollout_is_threshold=1.0)
    np.testing.assert_allclose(corr.is_weight_BxT, np.array([[0.75] * 4, [1.0, 1.0, 1.0, 0.0]]), rtol=1e-5)
    np.testing.assert_allclose(corr.metrics["rollout_corr/rollout_is_ratio_fraction_high"], 3 / 7, rtol=1e-6)
    np.testing.assert_allclose(corr.metrics["rollout_corr/rollout_is_max"], 1.8, rtol=1e-5)


def test_token_rejection():
    corr = _correct(rollout_rs="token", rollout_rs_threshold=2.0)  # lower: 1 / 2
    keep = np.array([[True, False, False, True], [True, True, True, False]])  # 3 and 0.25 out
    np.testing.assert_array_equal(corr.loss_mask_BxT, keep)
    np.testing.assert_allclose(corr.is_weight_BxT, keep.astype(float))  # no IS: weights 1
    np.testing.assert_allclose(corr.metrics["rollout_corr/rollout_rs_masked_fraction"], 2 / 7, rtol=1e-6)
    np.testing.assert_allclose(corr.metrics["rollout_corr/rollout_rs_seq_masked_fraction"], 1 / 2)
    assert "rollout_corr/rollout_is_mean" not in corr.metrics
    corr = _correct(rollout_rs="token", rollout_rs_threshold=2.0, rollout_rs_threshold_lower=0.2)
    np.testing.assert_array_equal(corr.loss_mask_BxT[0], [True, False, True, True])


@pytest.mark.parametrize(
    "level, lower, upper, keep_rows",
    [
        ("sequence", None, 1.5, [True, False]),  # products 0.75 and 1.8; lower 1 / 1.5 < 0.75
        ("sequence", 0.8, 2.0, [False, True]),
        ("geometric", 0.9, 1.2, [True, False]),  # means: 0.75^(1/4) = 0.93, 1.8^(1/3) = 1.22
        ("geometric", 0.95, 1.25, [False, True]),
        ("geometric", 0.9, 1.25, [True, True]),
    ],
)
def test_sequence_and_geometric_rejection(level, lower, upper, keep_rows):
    corr = _correct(rollout_rs=level, rollout_rs_threshold=upper, rollout_rs_threshold_lower=lower)
    assert 0.9 < 0.75**0.25 < 0.95 and 1.2 < 1.8 ** (1 / 3) < 1.25  # the hand values above
    want = MASK & np.array(keep_rows)[:, None]
    np.testing.assert_array_equal(corr.loss_mask_BxT, want)
    dropped = MASK.sum() - want.sum()
    np.testing.assert_allclose(
        corr.metrics["rollout_corr/rollout_rs_masked_fraction"], dropped / 7, rtol=1e-6
    )


def test_weights_scale_the_policy_gradient_terms():
    # r = 1 everywhere, A = +1: each token's term is -1, weighted -w; token-mean over 7 tokens.
    weight = np.array([[1.0, 2.0, 0.25, 1.0], [1.5, 1.2, 1.0, 0.0]])
    logp = jnp.zeros(RHO.shape)
    fn = lambda lp: objective.policy_loss(lp, jnp.zeros_like(lp), np.ones(2), MASK, is_weight_BxT=weight)[0]
    loss, grad = jax.value_and_grad(fn)(logp)
    np.testing.assert_allclose(loss, -weight.sum() / 7, rtol=1e-6)
    np.testing.assert_allclose(grad, -weight * MASK / 7, rtol=1e-6)  # d(-w r)/d logp = -w r


def test_bad_levels_are_refused():
    with pytest.raises(ValueError, match="unknown rollout_is 'seq'"):
        rc.CorrectionConfig(rollout_is="seq")
    with pytest.raises(ValueError, match="rollout_rs_threshold_lower < rollout_rs_threshold"):
        rc.CorrectionConfig(rollout_rs="token", rollout_rs_threshold=2.0, rollout_rs_threshold_lower=3.0)
    assert not rc.CorrectionConfig().corrects and rc.CorrectionConfig(rollout_rs="token").corrects
    assert math.isclose(rc.CorrectionConfig().rollout_is_threshold, 2.0)

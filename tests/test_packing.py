"""Packed rows: the host layout by hand, and the packed log-probs, loss and gradients equal to the
padded ones (f32)."""

import functools

import jax
import numpy as np
import pytest
from test_train_step import FAST_COMPILE, MODEL, init, loss_cfg, rollout, single_mesh

from dapo_jax import logprobs, objective, packing
from dapo_jax import train_step as ts


def test_first_fit_decreasing_by_hand():
    # width 10: 7 opens row 0, 6 row 1, 4 goes to row 1 (0 has 3 left), 3 to row 0, 2 to row 2
    row, start, rows = packing.first_fit_decreasing(np.array([3, 7, 0, 4, 6, 2]), 10)
    assert rows == 3
    np.testing.assert_array_equal(row, [0, 0, 0, 1, 1, 2])
    np.testing.assert_array_equal(start, [7, 0, 0, 6, 0, 0])
    with pytest.raises(ValueError, match="a row of 11 tokens does not fit packed rows of width 10"):
        packing.first_fit_decreasing(np.array([11]), 10)


def test_pack_segments_and_unpack_by_hand():
    mask = np.array(
        [
            [0, 1, 1, 1, 0, 0],  # 3 tokens from column 1
            [1, 1, 1, 1, 1, 0],  # 5
            [0, 0, 1, 1, 0, 0],  # 2
            [0, 1, 0, 0, 0, 0],  # 1
        ],
        bool,
    )
    x = np.arange(1, 25).reshape(4, 6) * mask
    p = packing.plan(mask, num_mini_batches=1, rows_multiple=2)
    # 5 -> row 0; 3 -> row 1; 2 -> row 1 (cols 3-4); 1 -> row 0 (col 5); 2 rows, a multiple of 2
    assert p.num_rows == 2
    np.testing.assert_array_equal(packing.pack(p, x), [[7, 8, 9, 10, 11, 20], [2, 3, 4, 15, 16, 0]])
    np.testing.assert_array_equal(packing.segments(p), [[1, 1, 1, 1, 1, 2], [1, 1, 1, 2, 2, 0]])
    np.testing.assert_array_equal(packing.unpack(p, packing.pack(p, x)), x)
    np.testing.assert_array_equal(packing.pack(p, np.array([1.0, 2.0, 3.0, 4.0]))[1], [1, 1, 1, 3, 3, 0])
    # two mini-batches packed apart into the rows the larger needs: {3, 5} two rows, {2, 1} one
    p2 = packing.plan(mask, num_mini_batches=2, rows_multiple=1)
    assert p2.num_rows == 4 and list(p2.row_B) == [1, 0, 2, 2] and list(p2.start_B) == [0, 0, 0, 2]
    with pytest.raises(ValueError, match="row 0's real tokens are not one contiguous run"):
        packing.plan(np.array([[1, 0, 1]], bool), 1, 1)


# packed rows' attention: the dense segment mask, or blocks of 4 of 16 columns (`blocked_attention`)
BLOCKS = pytest.mark.parametrize("chunk", [0, 4], ids=["dense", "blocked"])


def _packed(r: ts.Rollout, num_mini_batches=1, rows_multiple=2):
    p = packing.plan(r.mask_BxT, num_mini_batches, rows_multiple)
    return p, ts.Rollout(*packing.pack_rows(p, r.tokens_BxT, r.loss_mask_BxT, r.adv_B))


@BLOCKS
def test_packed_logprobs_unpack_to_the_padded_ones(chunk, attention_blocks):
    params, r = init(single_mesh()), rollout()
    p, packed = _packed(r)
    assert p.num_rows < len(r.adv_B)  # 8 rows of 16 columns in fewer
    logprobs_of = lambda m: jax.jit(
        functools.partial(logprobs.compute_logprobs, m, temperature=0.7),
        compiler_options=FAST_COMPILE,
    )
    padded = np.asarray(logprobs_of(MODEL)(params, r.tokens_BxT, r.mask_BxT))
    attention_blocks(chunk)
    got = packing.unpack(p, np.asarray(logprobs_of(MODEL)(params, packed.tokens_BxT, packed.mask_BxT)))
    on = r.loss_mask_BxT
    np.testing.assert_allclose(got[on], padded[on], rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    "agg_mode, chunk",
    [("token-mean", 0), ("token-mean", 4)]
    + [pytest.param(m, 0, marks=pytest.mark.slow) for m in ("seq-mean-token-mean", "seq-mean-token-sum")],
    ids=["token-mean-dense", "token-mean-blocked", "seq-mean-token-mean", "seq-mean-token-sum"],
)
def test_packed_loss_and_gradients_equal_the_padded_ones(agg_mode, chunk, attention_blocks):
    params, r = init(single_mesh()), rollout()
    noise = np.random.default_rng(1).normal(0, 0.3, (2, *r.tokens_BxT.shape)).astype(np.float32)
    logp = jax.jit(
        functools.partial(logprobs.compute_logprobs, MODEL, temperature=0.7),
        compiler_options=FAST_COMPILE,
    )(params, r.tokens_BxT, r.mask_BxT)
    old, ref = np.asarray(logp) + noise  # the clips are hit
    padded = ts.Batch(*r, old, ref)
    p, packed_rollout = _packed(r)
    packed = ts.Batch(*packed_rollout, packing.pack(p, old), packing.pack(p, ref))
    grads_of = lambda m: jax.jit(
        functools.partial(ts.loss_and_grads, m, loss_cfg(agg_mode)),
        static_argnums=2,
        compiler_options=FAST_COMPILE,
    )
    g_pad, m_pad = grads_of(MODEL)(params, padded, 1)
    attention_blocks(chunk)
    g_pack, m_pack = grads_of(MODEL)(params, packed, 2)  # and in 2 micro-batches of packed rows
    assert m_pad["pg_clipfrac_upper"] > 0
    for k in m_pad:
        np.testing.assert_allclose(m_pack[k], m_pad[k], rtol=1e-5, atol=1e-6, err_msg=k)
    flat = lambda g: np.concatenate([np.ravel(x) for x in jax.tree.leaves(g)])
    np.testing.assert_allclose(flat(g_pack), flat(g_pad), rtol=0, atol=1e-5 * np.abs(flat(g_pad)).max())


def test_sequence_loss_tokens_of_segments_by_hand():
    mask = np.array([[0, 1, 1, 0, 1, 1, 1, 0]], bool)
    seg = np.array([[1, 1, 1, 2, 2, 2, 2, 0]])
    np.testing.assert_array_equal(objective.sequence_loss_tokens(mask, seg), [[2, 2, 2, 3, 3, 3, 3, 0]])
    d = objective.denominators(mask, "seq-mean-token-sum", segment_BxT=seg)
    assert d.loss == 2 and d.tokens == 5

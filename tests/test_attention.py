"""Query-chunked attention: the same logits (at real tokens) and gradients as attention over all
queries at once, with padding rows and a last block of fewer queries, a fraction of its temporary
memory, and about half of its score FLOPs (each block reads only its causal prefix of keys)."""

import dataclasses

import jax
import numpy as np
import pytest

from dapo_jax import model, sharding

CONFIG = model.ModelConfig(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=96,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    qkv_bias=True,
    dtype="float32",
)


def _model(remat=False):
    return model.Transformer(dataclasses.replace(CONFIG, remat="nothing_saveable" if remat else None))


@pytest.fixture(scope="module")
def params():
    mesh = sharding.make_mesh({"data": -1}, devices=jax.devices()[:1])
    return sharding.init_params(_model(), mesh, jax.random.key(0))


def test_attention_block_by_hand():
    """All T queries while a row's T x S scores a head fit in 2^25, else the largest power of two
    C with C x S <= 2^25."""
    assert model.BLOCK_SCORES == 33_554_432
    # Qwen2.5-32B's trainer: T = S = 2048 + 20480 = 22,528; 2^25 / 22,528 = 1489.5 -> 1024
    assert model.attention_block(22_528, 22_528) == 1024
    # the tiny config's: T = S = 48 + 96 = 144, 144^2 = 20,736 scores: one block
    assert model.attention_block(144, 144) == 144
    # 5792^2 = 33,547,264 fits; 5793^2 = 33,558,849 does not: 2^25 / 5793 = 5792.2 -> 4096
    assert (model.attention_block(5792, 5792), model.attention_block(5793, 5793)) == (5792, 4096)
    # a prefill of 2048 queries into a cache of 22,528 slots: 2048 x 22,528 > 2^25 -> 1024
    assert model.attention_block(2048, 22_528) == 1024


def _loss(m, tokens, mask):
    return lambda p: (model.forward(m, p, tokens, mask)[..., :7] * mask[..., None]).sum()


@pytest.mark.slow
@pytest.mark.parametrize("remat", [False, True])  # causal prefixes unrolled; one block at a time
def test_chunked_equals_whole(params, remat, attention_blocks):
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, 96, (3, 20)).astype(np.int32)
    mask = np.arange(20)[None] >= np.array([[0], [5], [13]])  # left padding, 20 = 2 x 8 + 4
    m, logits, grads = _model(remat), [], []
    for chunk in (0, 8):  # whole, blocks of 8
        attention_blocks(chunk)
        logits.append(jax.jit(lambda p: model.forward(m, p, tokens, mask))(params))
        grads.append(jax.jit(jax.grad(_loss(m, tokens, mask)))(params))
    np.testing.assert_allclose(logits[1][mask], logits[0][mask], atol=1e-5)  # padding: don't care
    assert np.isfinite(logits[1]).all()
    for g0, g1 in zip(jax.tree.leaves(grads[0]), jax.tree.leaves(grads[1])):
        np.testing.assert_allclose(g1, g0, atol=1e-5, rtol=1e-4)
    assert max(float(np.abs(g).max()) for g in jax.tree.leaves(grads[0])) > 1e-2  # not all ~0


@pytest.mark.slow
def test_chunks_bound_the_scores_memory_with_remat(params, attention_blocks):
    tokens, mask = np.ones((2, 512), np.int32), np.ones((2, 512), bool)
    temp = {}
    for chunk in (0, 64):
        attention_blocks(chunk)
        grad = jax.jit(jax.grad(_loss(_model(remat=True), tokens, mask)))
        temp[chunk] = grad.lower(params).compile().memory_analysis().temp_size_in_bytes
    scores = 2 * CONFIG.num_heads * 512 * 512 * 4  # one layer's f32 scores over all queries
    assert temp[0] - temp[64] > CONFIG.num_layers * scores and temp[64] < temp[0] / 4, temp


@pytest.mark.slow
def test_causal_blocks_skip_the_masked_scores(params, attention_blocks):
    """Forward FLOPs of T = 512 in blocks of 64 (no remat) against all at once: block i computes
    64 x 64(i + 1) scores, not 64 x 512, so 28/64 of the scores are skipped, with their share of
    the q.k and p.v dots (2 x H FLOPs a score each) and of the softmax (a few FLOPs a score)."""
    tokens, mask = np.ones((2, 512), np.int32), np.ones((2, 512), bool)
    flops = {}
    for chunk in (0, 64):
        attention_blocks(chunk)
        forward = jax.jit(lambda p: model.forward(_model(), p, tokens, mask))
        flops[chunk] = forward.lower(params).compile().cost_analysis()["flops"]
    skipped_scores = CONFIG.num_layers * 2 * CONFIG.num_heads * 512 * 512 * 28 / 64  # B = 2
    dots = skipped_scores * 2 * (2 * CONFIG.head_dim)
    assert dots < flops[0] - flops[64] < dots + 8 * skipped_scores, (flops, dots)


def test_bfloat16_logits_are_within_tolerance_of_float32(params):
    """bf16 compute with f32 accumulation (scores, softmax, norms and logits in f32) runs on this
    backend for the teacher-forced pass, the prefill and a decode step, and stays within the stated
    tolerance of f32: max |logits_bf16 - logits_f32| <= 2.5% and the mean <= 0.5% of max |logits|
    (bf16 keeps 8 bits of mantissa: ~0.4% per rounding). Weights are scaled up to logits of order 1."""
    from dapo_jax import decoding

    p = jax.tree.map(lambda x: x * 5 if x.ndim == 2 else x, params)
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, 96, (3, 20)).astype(np.int32)
    mask = np.arange(20)[None] >= np.array([[0], [5], [13]])
    attn_BxS = np.concatenate([mask, np.ones((3, 1), bool), np.zeros((3, 11), bool)], axis=1)
    positions_B = mask.sum(1).astype(np.int32)
    slot_B = np.full((3,), 20, np.int32)

    def logits(dtype):
        m = model.Transformer(dataclasses.replace(CONFIG, dtype=dtype))
        teacher = jax.jit(lambda p: model.forward(m, p, tokens, mask))(p)
        caches = jax.jit(lambda p: decoding.prefill(m, p, tokens, mask, 32))(p)
        step = jax.jit(
            lambda p, c: decoding.decode_step(m, p, tokens[:, -1], positions_B, attn_BxS, c, slot_B)[0]
        )
        return np.asarray(teacher)[mask], np.asarray(step(p, caches))

    for got, want in zip(logits("bfloat16"), logits("float32")):
        scale = np.abs(want).max()
        assert scale > 1.0
        diff = np.abs(got - want)
        assert 0 < diff.max() <= 0.025 * scale and diff.mean() <= 0.005 * scale, (diff.max(), diff.mean())


def test_rope_tables_are_the_angles_cos_and_sin_and_nan_past_the_bound():
    """The looked-up tables equal cos and sin of position * theta^(-2i/d) in float64 numpy; a
    position at or past the bound reads NaN, not a clamped row."""
    positions = np.array([[0, 1, 5, 6], [3, 2, 0, 7]], np.int32)
    rope = model.rope_tables(positions, CONFIG, bound=7)
    inv_freq = 1.0 / CONFIG.rope_theta ** (np.arange(0, CONFIG.head_dim, 2) / CONFIG.head_dim)
    angles = positions[..., None, None] * inv_freq
    inside = positions < 7
    np.testing.assert_allclose(np.asarray(rope.cos)[inside], np.cos(angles)[inside], atol=1e-6)
    np.testing.assert_allclose(np.asarray(rope.sin)[inside], np.sin(angles)[inside], atol=1e-6)
    assert rope.cos.shape == (2, 4, 1, CONFIG.head_dim // 2)
    assert np.isnan(np.asarray(rope.cos)[~inside]).all() and np.isnan(np.asarray(rope.sin)[~inside]).all()


def _packed_rows():
    """Two packed rows of 20 columns: segments of 7, 5 and 8 tokens; of 3 and 9, then padding."""
    seg = np.array([[1] * 7 + [2] * 5 + [3] * 8, [1] * 3 + [2] * 9 + [0] * 8], np.int32)
    tokens = np.where(seg > 0, np.random.default_rng(1).integers(1, 96, seg.shape), 0).astype(np.int32)
    return tokens, seg


@pytest.mark.parametrize("remat", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_segment_blocks_equal_masked_attention_and_separate_rows(params, remat, attention_blocks):
    tokens, seg = _packed_rows()
    real = seg > 0
    m, logits, grads = _model(remat), [], []
    for chunk in (0, 4):  # the dense segment mask; blocks of 4
        attention_blocks(chunk)
        logits.append(jax.jit(lambda p: model.forward(m, p, tokens, seg))(params))
        grads.append(jax.jit(jax.grad(_loss(m, tokens, real)))(params))
    np.testing.assert_allclose(logits[1][real], logits[0][real], atol=1e-5)
    # each segment alone, as a row of its own, gives the same logits (positions restart)
    alone = jax.jit(lambda p, t: model.forward(m, p, t, np.ones(t.shape, bool)))(params, tokens[:1, 7:12])
    np.testing.assert_allclose(logits[1][0, 7:12], alone[0], atol=1e-5)
    for g0, g1 in zip(jax.tree.leaves(grads[0]), jax.tree.leaves(grads[1])):
        np.testing.assert_allclose(g1, g0, atol=1e-5, rtol=1e-4)
    assert max(float(np.abs(g).max()) for g in jax.tree.leaves(grads[0])) > 1e-2


def test_needed_blocks_by_hand():
    from dapo_jax.segment_attention import needed_blocks

    # blocks of 4 columns: row 0 [1111] [1112] [2222] [3333] [3333], row 1 [1112] [2222] [2222]
    # and two of padding; each row's blocks apart
    _, seg = _packed_rows()
    want_row0 = [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],  # segments 1 and 2 begin in blocks 0 and 1
        [0, 1, 1, 0, 0],  # segment 2 only: block 0 holds none of it
        [0, 0, 0, 1, 0],  # segment 3 begins at block 3
        [0, 0, 0, 1, 1],
    ]
    want_row1 = [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0],  # block 2 is segment 2, which began in block 0
        [0, 0, 0, 0, 0],  # padding reads nothing
        [0, 0, 0, 0, 0],
    ]
    np.testing.assert_array_equal(needed_blocks(seg, 4), np.array([want_row0, want_row1], bool))


def test_blocked_attention_equals_masked_attention():
    """Three rows (one segment over the whole row, three segments and padding, two short ones),
    T = 37 in blocks of 8 (the last one part padding): outputs and gradients of the dense
    segment mask's attention on every real token; padding's outputs 0."""
    from dapo_jax.segment_attention import blocked_attention

    rng = np.random.default_rng(0)
    b, t, k, g, h = 3, 37, 2, 2, 8
    seg = np.zeros((b, t), np.int32)
    seg[0, :10], seg[0, 10:30], seg[0, 30:35], seg[1], seg[2, :3], seg[2, 3:9] = 1, 2, 3, 1, 1, 2
    q, kk, v = (rng.normal(size=s).astype(np.float32) for s in ((b, t, k, g, h), (b, k, h, t), (b, k, t, h)))
    real = (seg > 0)[:, :, None, None, None]
    w = rng.normal(size=q.shape).astype(np.float32) * real
    dense = lambda q, kk, v: model.grouped_attention(q, kk, v, model.segment_attention_mask(seg), np.float32)
    blocked = lambda q, kk, v: blocked_attention(q, kk, v, seg, np.float32, 8)
    outs = [jax.jit(f)(q, kk, v) for f in (dense, blocked)]
    np.testing.assert_allclose(np.where(real, outs[1], 0), np.where(real, outs[0], 0), atol=1e-5)
    np.testing.assert_array_equal(np.where(real, 0, outs[1]), 0)
    grads = [
        jax.jit(jax.grad(lambda *a, f=f: (f(*a) * w).sum(), argnums=(0, 1, 2)))(q, kk, v)
        for f in (dense, blocked)
    ]
    for g0, g1 in zip(*grads):
        np.testing.assert_allclose(g1, g0, atol=1e-5)
        assert np.abs(g0).max() > 1


@pytest.mark.slow
def test_splash_kernel_equals_the_blocked_path_in_the_interpreter():
    """jax's splash attention kernel (the TPU path), run by the Pallas interpreter on this CPU:
    the blocked path's outputs and gradients on every real token; and it skips the blocks
    below the diagonal that no segment spans: with NaN values in segment 1's keys, the queries
    of segment 3 (whose blocks would read them, masked, if those blocks ran) stay finite."""
    from dapo_jax.segment_attention import blocked_attention, splash_attention

    rng = np.random.default_rng(0)
    b, t, k, g, h = 2, 384, 2, 2, 16
    seg = np.zeros((b, t), np.int32)  # blocks of 128: row 0 [1 1 .. 2 2] [3 ..] [3 .. 0 0], row 1 all 1
    seg[0, :100], seg[0, 100:128], seg[0, 128:300], seg[1] = 1, 2, 3, 1
    q, kk, v = (rng.normal(size=s).astype(np.float32) for s in ((b, t, k, g, h), (b, k, h, t), (b, k, t, h)))
    real = (seg > 0)[:, :, None, None, None]
    mesh = sharding.make_mesh({"data": -1}, devices=jax.devices()[:1])
    splash = lambda q, kk, v: splash_attention(q, kk, v, seg, block=128, interpret=True)
    blocked = lambda q, kk, v: blocked_attention(q, kk, v, seg, np.float32, 64)
    with jax.set_mesh(mesh):
        outs = [jax.jit(f)(q, kk, v) for f in (splash, blocked)]
        grads = [
            jax.jit(jax.grad(lambda *a, f=f: (f(*a) * real).sum(), argnums=(0, 1, 2)))(q, kk, v)
            for f in (splash, blocked)
        ]
        v_nan = v.copy()
        v_nan[0, :, :100] = np.nan
        nan_out = jax.jit(splash)(q, kk, v_nan)
    np.testing.assert_allclose(np.where(real, outs[0], 0), np.where(real, outs[1], 0), atol=2e-5)
    for g0, g1 in zip(*grads):
        np.testing.assert_allclose(g0, g1, atol=2e-4, rtol=1e-4)
    np.testing.assert_allclose(nan_out[0, 128:300], outs[1][0, 128:300], atol=2e-5)
    assert np.isnan(nan_out[0, :100]).all()  # segment 1 reads them

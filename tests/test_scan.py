"""Scanned layers (one compiled layer body, params stacked on "layers") == the unrolled loop:
logits, gradients, the sampler's cached decode, and HF safetensors in and out."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util

from dapo_jax import decoding, hf_io, hf_model_config, hf_save, logprobs, model, sampler, sharding, train_step


def _models(model_dir):
    cfg = hf_model_config.config_from_hf(hf_model_config.read_hf_config(model_dir), dtype="float32")
    return model.Transformer(cfg), model.Transformer(
        dataclasses.replace(cfg, scan_layers=True, remat="nothing_saveable")
    )


@pytest.fixture(scope="module")
def single():
    return sharding.make_mesh({"data": -1}, devices=jax.devices()[:1])


def _batch(vocab, b=3, t=11, seed=0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, vocab, size=(b, t)).astype(np.int32)
    mask = np.arange(t)[None] >= np.asarray([0, 3, 6][:b])[:, None]  # left padded
    return tokens, mask


def _close(a, b, tol=1e-5):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=tol, rtol=tol)


@pytest.mark.slow
@pytest.mark.parametrize("fixture", ["qwen2_dir", "qwen3_dir"])
def test_scanned_logits_and_gradients_equal_unrolled(fixture, request, single):
    model_dir = request.getfixturevalue(fixture)
    unrolled, scanned = _models(model_dir)
    params = hf_io.load_params(model_dir, unrolled, single)
    stacked = model.stack_layers(params, unrolled.config.num_layers)
    tokens, mask = _batch(unrolled.config.vocab_size)
    _close(model.forward(scanned, stacked, tokens, mask), model.forward(unrolled, params, tokens, mask))

    def loss(m):
        def f(p):
            logp, entropy = logprobs.model_logp_and_entropy(m, p, tokens, mask, 0.7)
            return jnp.sum(logp * mask) + jnp.sum(entropy * mask)

        return f

    g_unrolled = model.stack_layers(jax.grad(loss(unrolled))(params), unrolled.config.num_layers)
    g_scanned = jax.grad(loss(scanned))(stacked)
    # The gradients sum over every token: 1e-5 of each leaf's largest entry, not 1e-5 absolute
    # (one Qwen3 entry was off by 1.6e-5: the two programs sum in different orders).
    for a, b in zip(jax.tree.leaves(g_scanned), jax.tree.leaves(g_unrolled)):
        b = np.asarray(b)
        np.testing.assert_allclose(np.asarray(a), b, rtol=1e-5, atol=1e-5 * max(1.0, np.abs(b).max()))


def test_hf_folder_loads_stacked_and_round_trips(qwen2_dir, single, tmp_path):
    unrolled, scanned = _models(qwen2_dir)
    params = hf_io.load_params(qwen2_dir, unrolled, single)
    stacked = hf_io.load_params(qwen2_dir, scanned, single)
    assert stacked["layers"]["mlp"]["up_proj"]["kernel"].shape[0] == unrolled.config.num_layers
    expected = model.stack_layers(params, unrolled.config.num_layers)
    jax.tree.map(np.testing.assert_array_equal, stacked, expected)

    hf_save.save_params(stacked, hf_model_config.read_hf_config(qwen2_dir), str(tmp_path))
    again = hf_io.load_params(str(tmp_path), scanned, single)
    jax.tree.map(np.testing.assert_array_equal, again, stacked)
    flat_saved = traverse_util.flatten_dict(hf_io.load_params(str(tmp_path), unrolled, single))
    for path, x in traverse_util.flatten_dict(params).items():  # the same per-layer tensors
        np.testing.assert_array_equal(flat_saved[path], x)


@pytest.mark.slow
def test_scanned_sampler_equals_unrolled(qwen2_dir, single):
    unrolled, scanned = _models(qwen2_dir)
    params = hf_io.load_params(qwen2_dir, unrolled, single)
    stacked = model.stack_layers(params, unrolled.config.num_layers)
    cfg = decoding.SamplingConfig(
        max_new_tokens=12, eos_ids=(), pad_id=0, prompt_buckets=(8,), decode_chunks=2
    )
    tokens, mask = _batch(unrolled.config.vocab_size, t=8)
    outs = [
        sampler.Sampler(m, cfg, single).generate(p, tokens, mask, 2, jax.random.key(3))
        for m, p in ((unrolled, params), (scanned, stacked))
    ]
    np.testing.assert_array_equal(outs[0].tokens_BxN, outs[1].tokens_BxN)
    _close(outs[0].logp_BxN, outs[1].logp_BxN)
    caches = decoding.prefill(scanned, stacked, tokens, mask, 32)
    assert isinstance(caches, model.KVCache) and caches.v.shape[0] == unrolled.config.num_layers


def _head_case(vocab=512, d=16, b=2, t=64):
    cfg = model.ModelConfig(
        vocab_size=vocab,
        hidden_size=d,
        intermediate_size=8,
        num_layers=1,
        num_heads=1,
        num_kv_heads=1,
        head_dim=8,
        dtype="float32",
    )
    keys = jax.random.split(jax.random.key(0), 3)
    params = {"lm_head": {"kernel": jax.random.normal(keys[0], (d, vocab))}}
    x_BxTxD = jax.random.normal(keys[1], (b, t, d))
    targets_BxT = jax.random.randint(keys[2], (b, t), 0, vocab)
    return cfg, params, x_BxTxD, targets_BxT


@pytest.mark.slow
def test_chunked_logp_entropy_and_gradients_equal_unchunked():
    cfg, params, x_BxTxD, targets_BxT = _head_case(t=37)  # 37 tokens: a ragged last chunk
    logits_BxTxV = x_BxTxD @ params["lm_head"]["kernel"]
    want = jax.tree.map(
        np.asarray, train_step.objective.token_logp_and_entropy(logits_BxTxV, targets_BxT, 0.8)
    )

    def value(p, x, chunk):
        logp, entropy = logprobs.chunked_logp_and_entropy(cfg, p, x, targets_BxT, 0.8, chunk)
        return jnp.sum(logp * jnp.arange(37)) + jnp.sum(entropy), (logp, entropy)

    grads = jax.grad(value, argnums=(0, 1), has_aux=True)
    g_full, _ = grads(params, x_BxTxD, 37)  # one block
    for chunk in (8, 16):
        got = value(params, x_BxTxD, chunk)[1]
        _close(got[0], want[0])
        _close(got[1], want[1])
        jax.tree.map(_close, grads(params, x_BxTxD, chunk)[0], g_full)


def test_logits_block_by_hand():
    """All T tokens while a row's T x V logits fit in 2^29, else the largest power of two C with
    C x V <= 2^29 (at least 1)."""
    assert logprobs.BLOCK_LOGITS == 536_870_912
    # Qwen2.5-32B: V = 152,064, T = 2048 + 20480 = 22,528; 2^29 / 152,064 = 3530.6 -> 2048
    assert logprobs.logits_block(22_528, 152_064) == 2048
    # SmolLM2-135M: V = 49,152, T = 72 + 64 = 136, 6,684,672 logits: one block
    assert logprobs.logits_block(136, 49_152) == 136
    # 10,922 x 49,152 = 536,838,144 fits; 10,923 x 49,152 = 536,887,296 does not -> 8192
    assert (logprobs.logits_block(10_922, 49_152), logprobs.logits_block(10_923, 49_152)) == (10_922, 8192)
    assert logprobs.logits_block(4, 2**30) == 1  # a row past the budget alone: one token a block


def _temp_bytes(chunk, remat=True):
    cfg, params, x_BxTxD, targets_BxT = _head_case(vocab=4096, d=32, b=2, t=256)

    def loss(p, x):
        logp, entropy = logprobs.chunked_logp_and_entropy(cfg, p, x, targets_BxT, 1.0, chunk, remat=remat)
        return jnp.sum(logp) + jnp.sum(entropy)

    compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(params, x_BxTxD).compile()
    return compiled.memory_analysis().temp_size_in_bytes


@pytest.mark.slow
def test_chunked_backward_holds_one_chunk_of_logits():
    full_logits = 2 * 256 * 4096 * 4  # B x T x V f32: 8 MiB (XLA:CPU held 4 such arrays)
    unchunked, chunked, no_remat = _temp_bytes(256), _temp_bytes(32), _temp_bytes(32, remat=False)
    assert unchunked >= 2 * full_logits
    assert chunked < full_logits / 1.5  # 32 of 256 tokens: ~1/8 of the unchunked
    assert no_remat >= 2 * full_logits  # without remat each chunk's residuals stay: T x V again

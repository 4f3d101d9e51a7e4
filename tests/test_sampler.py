"""The sampler: cached decode == teacher forcing, greedy == transformers, logp == the trainer's,
no recompilation within buckets, reproducible per-row keys, sharded == single device."""

import dataclasses

import jax
import numpy as np
import pytest
import torch
import transformers
from jax.sharding import PartitionSpec as P

from dapo_jax import decoding, hf_io, hf_model_config, model, sampler, sharding

VOCAB = 96


def _load(model_dir, mesh, **numerics):
    hf = hf_model_config.read_hf_config(model_dir)
    m = model.Transformer(hf_model_config.config_from_hf(hf, dtype="float32", **numerics))
    return m, hf_io.load_params(model_dir, m, mesh)


@pytest.fixture(scope="module")
def single():
    return sharding.make_mesh({"data": -1}, devices=jax.devices()[:1])


@pytest.fixture(scope="module")
def qwen2(qwen2_dir, single):
    return _load(qwen2_dir, single)


def _prompts(lengths, width, seed=0):
    """Random left-padded prompts `tokens_PxQ, mask_PxQ` (pad id 0) of the given real lengths."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, VOCAB, size=(len(lengths), width)).astype(np.int32)
    mask = np.arange(width)[None] >= width - np.asarray(lengths)[:, None]
    tokens[~mask] = 0
    return tokens, mask


def _config(**kw):
    return decoding.SamplingConfig(
        **{"max_new_tokens": 10, "eos_ids": (), "pad_id": 0, "prompt_buckets": (8, 16), **kw}
    )


@pytest.mark.parametrize("transposed_keys", [False, True])
def test_write_cache_at_a_shared_slot_equals_per_row_slots(transposed_keys):
    """A scalar slot (the fixed batch's one in-place update) writes what per-row slots that are all
    equal write (the scatter continuous batching uses), both equal to numpy's assignment."""
    b, k, s, t, h = 3, 2, 9, 2, 4
    rng = np.random.default_rng(0)
    cache_k = rng.normal(size=(b, k, h, s) if transposed_keys else (b, k, s, h)).astype(np.float32)
    cache = model.KVCache(cache_k, rng.normal(size=(b, k, s, h)).astype(np.float32))
    new_k, new_v = rng.normal(size=(2, b, k, t, h)).astype(np.float32)
    want_k, want_v = cache.k.copy(), cache.v.copy()
    if transposed_keys:
        want_k[:, :, :, 5 : 5 + t] = new_k.swapaxes(2, 3)
    else:
        want_k[:, :, 5 : 5 + t] = new_k
    want_v[:, :, 5 : 5 + t] = new_v
    for index in (np.int32(5), np.full((b,), 5, np.int32)):
        got = model.write_cache(cache, new_k, new_v, index, transposed_keys)
        np.testing.assert_array_equal(got.k, want_k)
        np.testing.assert_array_equal(got.v, want_v)


@pytest.mark.parametrize(
    "fixture, transposed_keys", [("qwen2_dir", False), ("qwen2_dir", True), ("llama_dir", False)]
)
def test_cached_decode_equals_teacher_forced_forward(fixture, transposed_keys, request, single):
    m, params = _load(request.getfixturevalue(fixture), single, transposed_keys=transposed_keys)
    prompt, mask = _prompts([8, 5, 2], 8)
    follow = np.random.default_rng(1).integers(1, VOCAB, size=(3, 6)).astype(np.int32)
    full_tokens = np.concatenate([prompt, follow], 1)
    full_mask = np.concatenate([mask, np.ones_like(follow, bool)], 1)
    ref_BxTxV = np.asarray(model.forward(m, params, full_tokens, full_mask))

    s = 32  # a cache longer than needed: the unused slots must stay unread
    caches = jax.jit(lambda p, t, k: decoding.prefill(m, p, t, k, s))(params, prompt[:, :-1], mask[:, :-1])
    step = jax.jit(lambda p, *args: decoding.decode_step(m, p, *args))
    readable_BxS = np.concatenate([mask, np.ones((3, s - 8), bool)], 1)
    feed_BxT = full_tokens[:, 7:]
    for t in range(feed_BxT.shape[1]):
        attn_BxS = readable_BxS & (np.arange(s) <= 7 + t)
        slot_B = np.full(3, 7 + t, np.int32)
        logits_BxV, caches = step(params, feed_BxT[:, t], mask.sum(1) - 1 + t, attn_BxS, caches, slot_B)
        np.testing.assert_allclose(np.asarray(logits_BxV), ref_BxTxV[:, 7 + t], atol=1e-4, rtol=1e-4)


def _hf_greedy(model_dir, prompt, mask, new_tokens, eos_id):
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    out = hf.generate(
        input_ids=torch.tensor(prompt, dtype=torch.long),
        attention_mask=torch.tensor(mask, dtype=torch.long),
        max_new_tokens=new_tokens,
        do_sample=False,
        eos_token_id=eos_id,
        pad_token_id=0,
    )
    completion = out[:, prompt.shape[1] :].numpy()
    return np.pad(completion, ((0, 0), (0, new_tokens - completion.shape[1])))  # HF stops when all end


def test_greedy_equals_transformers_generate(qwen2_dir, qwen2, single):
    m, params = qwen2
    prompt, mask = _prompts([16, 11, 4, 9], 16, seed=3)
    n_new = 12
    free = sampler.Sampler(m, _config(max_new_tokens=n_new, greedy=True), single)
    ours = np.asarray(free.generate(params, prompt, mask, 1, jax.random.key(0)).tokens_BxN)
    np.testing.assert_array_equal(ours, _hf_greedy(qwen2_dir, prompt, mask, n_new, None))
    assert len(np.unique(ours)) > 8  # a meaningful comparison, not one token repeated

    # Stop on an id that row 2 first emits at step 3: both stop that row there and pad after it.
    eos = int(ours[2, 3])
    assert eos not in ours[2, :3]
    stopping = sampler.Sampler(m, _config(max_new_tokens=n_new, greedy=True, eos_ids=(eos,)), single)
    out = stopping.generate(params, prompt, mask, 1, jax.random.key(0))
    tokens = np.asarray(out.tokens_BxN)
    np.testing.assert_array_equal(tokens, _hf_greedy(qwen2_dir, prompt, mask, n_new, eos))
    assert tokens[2, 4:].tolist() == [0] * (n_new - 4)
    assert int(out.length_B[2]) == 4 and not bool(out.truncated_B[2])


def test_logp_equals_trainer_recompute_with_truncation(qwen2, single):
    m, params = qwen2
    cfg = _config(max_new_tokens=16, temperature=0.7, top_p=0.8, top_k=12, eos_ids=(3, 5, 7, 11))
    prompt, mask = _prompts([8, 3], 8, seed=5)
    out = jax.device_get(sampler.Sampler(m, cfg, single).generate(params, prompt, mask, 4, jax.random.key(7)))
    tokens, logp, comp_mask, length = out.tokens_BxN, out.logp_BxN, out.mask_BxN, out.length_B
    ended = ~out.truncated_B
    assert ended.any() and not ended.all()  # both outcomes are exercised

    # The trainer's recomputation: one teacher-forced forward over prompt + completion.
    full_tokens = np.concatenate([np.repeat(prompt, 4, 0), tokens], 1)
    full_mask = np.concatenate([np.repeat(mask, 4, 0), comp_mask], 1)
    logits_BxNxV = np.asarray(model.forward(m, params, full_tokens, full_mask))[:, 7:-1]
    ref_logp_BxNxV = np.asarray(jax.nn.log_softmax(logits_BxNxV / cfg.temperature))
    ref = np.take_along_axis(ref_logp_BxNxV, tokens[..., None], -1)[..., 0]
    np.testing.assert_allclose(logp[comp_mask], ref[comp_mask], atol=1e-5)
    assert np.all(logp[~comp_mask] == 0) and np.all(tokens[~comp_mask] == 0)

    # Truncation: every draw lies in the top k and in the top-p nucleus of the renormalised top k.
    ref_BxN = ref_logp_BxNxV[comp_mask]
    drawn = ref[comp_mask]
    assert np.all((ref_BxN > drawn[:, None]).sum(-1) < cfg.top_k)
    top_k_logp = np.sort(ref_BxN, -1)[:, -cfg.top_k :]
    top_k_probs = np.exp(top_k_logp) / np.exp(top_k_logp).sum(-1, keepdims=True)
    mass_above = np.where(top_k_logp > drawn[:, None], top_k_probs, 0).sum(-1)
    assert np.all(mass_above < cfg.top_p)
    # Ends: a row ends at its first end id, kept in its length; truncated rows never met one.
    is_eos = np.isin(tokens, cfg.eos_ids) & comp_mask
    assert np.all(is_eos.sum(1) == ended)
    assert np.all(is_eos[ended, length[ended] - 1])
    assert np.all(length[~ended] == cfg.max_new_tokens)


@pytest.mark.slow
def test_no_recompilation_within_buckets(qwen2, single):
    m, params = qwen2
    s = sampler.Sampler(m, _config(max_new_tokens=4), single)
    key = jax.random.key(0)
    for lengths, width in [([8, 2], 8), ([16, 9], 16)]:  # warm up both buckets
        s.generate(params, *_prompts(lengths, width), 2, key)
    assert s.num_traces == 2
    for lengths, width in [([5, 3], 5), ([7, 1], 12), ([12, 15], 15), ([10, 9], 20), ([1, 1], 1)]:
        out = s.generate(params, *_prompts(lengths, width), 2, key)
        assert out.tokens_BxN.shape == (4, 4)
    assert s.num_traces == 2
    with pytest.raises(ValueError, match="exceeds the largest bucket"):
        s.generate(params, *_prompts([17, 3], 17), 2, key)
    with pytest.raises(ValueError, match="left padded"):
        s.generate(params, *(x[:, ::-1] for x in _prompts([5, 3], 8)), 2, key)


@pytest.mark.slow
def test_reproducible_and_independent_of_batch_composition(qwen2, single):
    m, params = qwen2
    s = sampler.Sampler(m, _config(max_new_tokens=12), single)
    (a, b, c), mask = _prompts([7, 7, 7], 8, seed=2)
    tokens = lambda prompts, uids, key: np.asarray(
        s.generate(params, np.stack(prompts), mask[[0, 0]], 3, key, uids_P=uids).tokens_BxN
    )
    key = jax.random.key(11)
    ab = tokens([a, b], [0, 1], key)
    np.testing.assert_array_equal(ab, tokens([a, b], [0, 1], key))
    ca = tokens([c, a], [5, 0], key)  # prompt a moves to the second place beside another prompt
    np.testing.assert_array_equal(ca[3:], ab[:3])
    assert not np.array_equal(ab[0], ab[1])  # the G samples of a group differ
    assert not np.array_equal(tokens([a, b], [0, 1], jax.random.key(12))[:3], ab[:3])


@pytest.mark.slow
def test_sharded_equals_single_device(qwen2_dir, qwen2, single):
    m, params = qwen2
    cfg = _config(max_new_tokens=8, greedy=True, temperature=0.9)
    prompt, mask = _prompts([8, 3, 6, 5], 8, seed=4)
    ref = sampler.Sampler(m, cfg, single).generate(params, prompt, mask, 2, jax.random.key(0))

    mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    _, sharded_params = _load(qwen2_dir, mesh)
    out = sampler.Sampler(m, cfg, mesh).generate(sharded_params, prompt, mask, 2, jax.random.key(0))
    assert out.tokens_BxN.sharding.spec == P(("data", "fsdp"), None)
    np.testing.assert_array_equal(np.asarray(out.tokens_BxN), np.asarray(ref.tokens_BxN))
    np.testing.assert_allclose(np.asarray(out.logp_BxN), np.asarray(ref.logp_BxN), atol=1e-5)
    # 3 prompts x 1 row do not split over data x fsdp = 4: filled to 4 prompts, the fill dropped
    odd = sampler.Sampler(m, cfg, mesh).generate(sharded_params, prompt[:3], mask[:3], 1, jax.random.key(0))
    np.testing.assert_array_equal(np.asarray(odd.tokens_BxN), np.asarray(ref.tokens_BxN)[0:6:2])


@pytest.mark.parametrize("vocab", [1, 7, 96, 1000])
def test_inverse_cdf_draw_equals_searchsorted(vocab):
    """The two-level draw picks the first token whose cumulative probability reaches u * total,
    as numpy's float64 searchsorted does, and never a token of probability 0."""
    rng = np.random.default_rng(vocab)
    probs = rng.random((256, vocab)) * (rng.random((256, vocab)) < 0.4)
    probs[:, rng.integers(vocab, size=256)] += 0.1  # at least one positive entry per row
    probs[0] = 0
    probs[0, -1] = 1.0  # all mass on the last token
    u = 1.0 - rng.random(256)
    u[1] = 1.0
    drawn = np.asarray(
        decoding.draw_inverse_cdf(jax.numpy.asarray(probs, "float32"), jax.numpy.asarray(u, "float32"))
    )
    cdf = np.cumsum(probs, -1)
    expected = [np.searchsorted(cdf[i], u[i] * cdf[i, -1]) for i in range(256)]
    np.testing.assert_array_equal(drawn, expected)
    assert np.all(probs[np.arange(256), drawn] > 0)


@pytest.mark.slow
def test_decode_chunks_leave_rollouts_unchanged(qwen2, single):
    m, params = qwen2
    prompt, mask = _prompts([8, 3, 6], 8, seed=6)
    out = [
        jax.device_get(
            sampler.Sampler(m, _config(eos_ids=tuple(range(3, 15)), decode_chunks=c), single).generate(
                params, prompt, mask, 2, jax.random.key(3)
            )
        )
        for c in (1, 3)
    ]
    assert (~out[0].truncated_B).any() and out[0].truncated_B.any()
    np.testing.assert_array_equal(out[0].tokens_BxN, out[1].tokens_BxN)
    np.testing.assert_array_equal(out[0].length_B, out[1].length_B)
    np.testing.assert_allclose(out[0].logp_BxN, out[1].logp_BxN, atol=1e-5)


@pytest.mark.slow
def test_rollout_micro_batches_leave_rollouts_unchanged(qwen2, single):
    m, params = qwen2
    prompt, mask = _prompts([8, 3, 6, 5], 8, seed=7)
    cfg = _config(eos_ids=tuple(range(3, 15)))
    whole = jax.device_get(
        sampler.Sampler(m, cfg, single).generate(params, prompt, mask, 2, jax.random.key(4))
    )
    parts = sampler.Sampler(m, cfg, single, micro_batch_prompts=3)  # 3 + 1 prompts
    split = jax.device_get(parts.generate(params, prompt, mask, 2, jax.random.key(4)))
    assert parts.num_traces == 2 and split.tokens_BxN.shape == whole.tokens_BxN.shape
    for k in ("tokens_BxN", "length_B", "truncated_B", "mask_BxN"):
        np.testing.assert_array_equal(getattr(split, k), getattr(whole, k))
    np.testing.assert_allclose(split.logp_BxN, whole.logp_BxN, atol=1e-5)


@pytest.mark.parametrize("paged,slots", [(False, None), (True, 8)])
def test_a_loop_per_device_equals_one_device(qwen2_dir, qwen2, single, paged, slots):
    """On a data-only mesh of 4 devices, a loop per device (`shard_map`, no collective in the
    program; 6 prompts filled up to 8): every row gets the tokens, lengths and log-probs of one
    device's fixed batch, with fixed batches and with the engine's slots."""
    m, params = qwen2
    prompt, mask = _prompts([8, 3, 6, 1, 5, 7, 2, 8], 8, seed=9)
    cfg = _config(eos_ids=tuple(range(3, 11)), temperature=0.8)
    uids = [4, 1, 7, 2, 9, 3, 0, 5]
    key = jax.random.key(6)
    ref = jax.device_get(sampler.Sampler(m, cfg, single).generate(params, prompt, mask, 2, key, uids_P=uids))
    assert ref.truncated_B.any() and not ref.truncated_B.all()
    mesh = sharding.make_mesh({"data": 4}, devices=jax.devices()[:4])
    _, mesh_params = _load(qwen2_dir, mesh)
    s = sampler.Sampler(m, dataclasses.replace(cfg, paged=paged, decode_slots=slots, page_size=4), mesh)
    for p in (8, 4, 6):
        out = s.generate(mesh_params, prompt[:p], mask[:p], 2, key, uids_P=uids[:p])
        if p % 4 == 0:  # filled prompts' rows come back replicated, after the fill's are dropped
            assert out.tokens_BxN.sharding.spec == P(("data", "fsdp"), None)
        out = jax.device_get(out)
        for k in ("tokens_BxN", "length_B", "truncated_B", "mask_BxN"):
            np.testing.assert_array_equal(
                getattr(out, k), getattr(ref, k)[: 2 * p], err_msg=f"{k}, {p} prompts"
            )
        np.testing.assert_allclose(out.logp_BxN, ref.logp_BxN[: 2 * p], atol=1e-6)
    assert s.num_traces == 2  # one program per P after the fill: 6 prompts run as 8
    rows = (mesh_params, prompt[:4], mask[:4], np.asarray(uids[:4], np.int32), key)
    hlo = s._rollout_fn(2).lower(*rows).compile().as_text()
    assert "all-reduce" not in hlo and "all-gather" not in hlo


def test_decode_slots_are_checked(qwen2):
    m, _ = qwen2
    with pytest.raises(ValueError, match=r"decode_slots must be >= 1 \(None: every row\), got 0"):
        _config(paged=True, decode_slots=0)
    with pytest.raises(ValueError, match="decode_slots 4 sets the engine's slots: set paged=True"):
        _config(decode_slots=4)
    mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    with pytest.raises(ValueError, match="decode_slots 6: .* over the 4 devices .* 4 and 8$"):
        sampler.Sampler(m, _config(paged=True, decode_slots=6), mesh)
    sampler.Sampler(m, _config(paged=True, decode_slots=8), mesh)


@pytest.mark.parametrize("scan_layers", [False, True])
def test_transposed_keys_leave_rollouts_unchanged(qwen2_dir, single, scan_layers):
    """Keys cached as [B, K, E, S]: the plain layout's rollouts, through grown decode phases
    (fixed batch) and prefills copied into pages (the engine), per-layer or stacked."""
    prompt, mask = _prompts([8, 3, 6, 5], 8, seed=9)
    cfgs = [
        _config(eos_ids=tuple(range(3, 15)), decode_chunks=3),
        _config(eos_ids=tuple(range(3, 15)), paged=True, decode_slots=3, page_size=4),
    ]
    out = {}
    for transposed in (False, True):
        m, params = _load(qwen2_dir, single, transposed_keys=transposed, scan_layers=scan_layers)
        k = jax.tree.leaves(model.init_cache(m.config, 1, 5))[0]  # 5 slots, head_dim 16
        assert k.shape[-2:] == ((m.config.head_dim, 5) if transposed else (5, m.config.head_dim))
        out[transposed] = [
            jax.device_get(sampler.Sampler(m, c, single).generate(params, prompt, mask, 2, jax.random.key(6)))
            for c in cfgs
        ]
    for plain, transposed in zip(out[False], out[True]):
        assert (~plain.truncated_B).any() and plain.truncated_B.any()
        for k in ("tokens_BxN", "length_B", "truncated_B"):
            np.testing.assert_array_equal(getattr(transposed, k), getattr(plain, k))
        np.testing.assert_allclose(transposed.logp_BxN, plain.logp_BxN, atol=1e-5)


def test_a_shard_runs_its_share_of_the_engines_slots():
    """512 slots over 8 data shards: 64 a shard's loop (the 32B config's); None (every row) stays None."""
    assert _config(paged=True, decode_slots=512).for_shard(8).decode_slots == 64
    assert _config(paged=True).for_shard(8).decode_slots is None

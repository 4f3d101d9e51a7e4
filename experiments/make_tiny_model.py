"""Build the tiny base model that the project ships: a character-level tokenizer and a ~0.8M-parameter
Qwen2, supervised on worked solutions of the synthetic arithmetic task (dapo_jax.synthetic).

Two stages, so that RL has something to find (issue: a base model with headroom):

    python experiments/make_tiny_model.py --out /tmp/careful --steps 1000
    python experiments/make_tiny_model.py --init /tmp/careful --out assets/tiny-qwen2 \
        --steps 150 --lr 5e-4 --direct_fraction 0.5

The first (about 15-23 minutes on 2 CPU cores) learns to work one operation a line: held-out
avg@4 0.66 at T = 1 (0.84 at top_p 0.7). The second (about 2 minutes) continues on a mix in which
half the solutions give the answer at once (`with_direct_answers`): the model then starts with either
style, and held-out avg@4 at T = 1 is 0.32. DAPO finds out that working pays. It writes a Hugging Face
model directory (config.json, model.safetensors, tokenizer) that `hf_io.load_params` and
transformers both load.
"""

import argparse
import json
import os
import sys
import time

import jax
import numpy as np
import optax
import pyarrow.parquet as pq
import tokenizers
import transformers
from tokenizers import decoders, models

from dapo_jax import hf_io, hf_model_config, hf_save, model, sft, sharding, synthetic

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "peers"))
import workload  # noqa: E402

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # pad, turn start, end of turn (EOS)
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# The benchmark's Qwen2 (experiments/peers/workload.py) at 4 layers and 1024 positions.
HF_CONFIG = {**workload.HF_CONFIG, "num_hidden_layers": 4, "max_position_embeddings": 1024}


def build_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """One token per printable ASCII character and newline, plus the chat special tokens."""
    chars = ["\n"] + [chr(i) for i in range(32, 127)]
    vocab = {t: i for i, t in enumerate(list(SPECIALS) + chars)}
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    tok.add_special_tokens(list(SPECIALS))
    tok.decoder = decoders.Fuse()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=CHAT_TEMPLATE
    )


def sft_arrays(tokenizer, rows, seq_len):
    """`sft.sft_batch` of rows: the chat-templated bare problem, its worked solution, EOS."""
    prompts = [
        tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False)
        for row in rows
    ]
    x = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    y = tokenizer([row["extra_info"]["solution"] for row in rows], add_special_tokens=False)["input_ids"]
    return sft.sft_batch(x, y, tokenizer.eos_token_id, tokenizer.pad_token_id, seq_len)


def with_direct_answers(rows, fraction: float, seed: int) -> None:
    """Replaces the worked solution of a random `fraction` of rows by the bare answer line.

    The base model then learns two styles and picks one at its first token, whatever the
    problem: working one operation a line (right most of the time) or answering at once (right
    on short sums, rarely on long ones). Which one pays is what RL can find out, and the choice
    is the same for every problem, so what it learns on training prompts holds on held-out ones.
    """
    rng = np.random.default_rng([seed, 1])
    for row, direct in zip(rows, rng.random(len(rows)) < fraction):
        if direct:
            row["extra_info"]["solution"] = "Answer: " + row["reward_model"]["ground_truth"]


def train(params, m, tokenizer, rows, *, steps, batch, seq_len, lr, seed):
    schedule = optax.warmup_cosine_decay_schedule(0.0, lr, min(100, steps // 5), steps, lr * 0.1)
    opt = optax.adamw(schedule, weight_decay=0.01)
    opt_state = opt.init(params)
    step = sft.make_sft_step(m, opt)
    rng = np.random.default_rng(seed)
    start = time.time()
    for i in range(steps):
        chosen = [rows[j] for j in rng.integers(0, len(rows), batch)]
        params, opt_state, loss = step(params, opt_state, *sft_arrays(tokenizer, chosen, seq_len))
        if i % 50 == 0 or i == steps - 1:
            print(f"step {i:5d}  loss {float(loss):.4f}  {time.time() - start:6.0f}s", flush=True)
    return params


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="assets/tiny-qwen2")
    parser.add_argument("--steps", type=int, default=1000, help="SFT steps; few on purpose")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--seq_len", type=int, default=128)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--direct_fraction",
        type=float,
        default=0.0,
        help="share of SFT solutions that give the answer without working",
    )
    parser.add_argument(
        "--init", default=None, help="continue from this model directory instead of random weights"
    )
    args = parser.parse_args()

    tokenizer = build_tokenizer()
    test_path = os.path.join("data", "synthetic", "test.parquet")
    test_problems = frozenset(r["prompt"][0]["content"] for r in pq.read_table(test_path).to_pylist())
    rows = synthetic.generate(50_000, seed=1000 + args.seed, exclude=test_problems)
    with_direct_answers(rows, args.direct_fraction, seed=args.seed)

    cfg = hf_model_config.config_from_hf(HF_CONFIG, dtype="float32")
    m = model.Transformer(cfg)
    mesh = sharding.make_mesh({"data": -1}, devices=jax.devices()[:1])
    params = (
        hf_io.load_params(args.init, m, mesh)
        if args.init
        else sharding.init_params(m, mesh, jax.random.key(args.seed))
    )
    params = train(
        params,
        m,
        tokenizer,
        rows,
        steps=args.steps,
        batch=args.batch,
        seq_len=args.seq_len,
        lr=args.lr,
        seed=args.seed,
    )

    hf_save.save_params(params, HF_CONFIG, args.out)
    tokenizer.save_pretrained(args.out)
    with open(os.path.join(args.out, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": 2, "pad_token_id": 0, "bos_token_id": 1}, f, indent=2)
    print(f"saved {cfg.num_params():,} parameters and the tokenizer to {args.out}")


if __name__ == "__main__":
    main()

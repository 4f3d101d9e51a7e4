"""The DAPO paper's ablation table (docs/dapo_spec.md section 9) as data: each row adds one technique to the
row above, from naive GRPO (`configs/grpo.py`) to full DAPO (`configs/dapo.py`, key for key).
One argument picks the row and the scale:

    python -m dapo_jax.train --config=configs/ablation.py:clip_higher,tiny --workdir=runs/clip_higher

Choices the paper leaves open: soft overlong punishment replaces overlong filtering (row
`soft_overlong` turns the filter off again): DAPO's algorithm and the reference recipe punish
overlong responses and never filter them, and the last row must be DAPO. The filter sizes of the
last row (generation batch, max generation batches) are DAPO's; rows without the filter draw one
train batch of prompts per step.
"""

import ml_collections

from configs import dapo, grpo
from dapo_jax import overrides

DAPO = object()  # "configs/dapo.py's value of this key, at the same scale"

# (row, the keys this row sets), in the table's order; each row keeps the rows above it.
ROWS = (
    ("naive_grpo", {}),
    ("overlong_filter", {"reward.overlong_filter": True}),
    ("clip_higher", {"loss.eps_high": DAPO}),
    ("soft_overlong", {"reward.overlong_penalty": DAPO, "reward.overlong_filter": DAPO}),
    ("token_level_loss", {"loss.agg_mode": DAPO}),
    (
        "dynamic_sampling",
        {"filter.enable": DAPO, "filter.gen_batch_prompts": DAPO, "filter.max_num_gen_batches": DAPO},
    ),
)
ROW_NAMES = tuple(name for name, _ in ROWS)

# The paper's table (AIME 2024 avg@32, Qwen2.5-32B base), printed beside ours by the report.
PAPER_AIME24 = {
    "naive_grpo": 30,
    "overlong_filter": 36,
    "clip_higher": 38,
    "soft_overlong": 41,
    "token_level_loss": 42,
    "dynamic_sampling": 50,
}

# `python -m dapo_jax.ablation run --quick`: every run shrunk to seconds (tests, smoke runs).
QUICK = {
    "train.steps": 2,
    "train.train_batch_prompts": 4,
    "train.mini_batch_prompts": 2,
    "train.micro_batch_size": 8,
    "rollout.group_size": 4,
    "rollout.max_new_tokens": 40,
    "reward.overlong_buffer": 8,
    "reward.num_workers": 1,
    "filter.gen_batch_prompts": 8,
    "filter.max_num_gen_batches": 2,
    "eval.max_problems": 8,
    "eval.samples": 2,
    "eval.batch_prompts": 8,
    "eval.every": 1,
    "checkpoint.every": 2,
}

# The SFT control: continued SFT on the training prompts' worked solutions with the DAPO row's
# updates and sequences per update, at the learning rate the base model's own SFT ended at.
SFT = {"lr": 2e-4}


def get_config(arg: str = "naive_grpo,tiny") -> ml_collections.ConfigDict:
    row, _, scale = arg.partition(",")
    if row not in ROW_NAMES:
        raise ValueError(f"unknown ablation row {row!r}; choose from {ROW_NAMES}")
    scale = scale or "tiny"
    c, reference = grpo.get_config(scale), dapo.get_config(scale)
    for _, keys in ROWS[: ROW_NAMES.index(row) + 1]:
        overrides.apply(c, {k: overrides.get(reference, k) if v is DAPO else v for k, v in keys.items()})
    return c

"""The DAPO paper's ablation table (spec section 9) as data: each row adds one technique to the
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

DAPO = object()  # "configs/dapo.py's value of this key, at the same scale"

# (row, the keys this row sets), in the table's order; each row keeps the rows above it.
ROWS = (
    ("naive_grpo", {}),
    ("overlong_filter", {"reward.overlong_filter": True}),
    ("clip_higher", {"loss.eps_high": DAPO}),
    ("soft_overlong", {"reward.overlong_penalty": DAPO, "reward.overlong_filter": DAPO}),
    ("token_level_loss", {"loss.agg_mode": DAPO}),
    ("dynamic_sampling", {"filter.enable": DAPO, "filter.gen_batch_prompts": DAPO,
                          "filter.max_num_gen_batches": DAPO}),
)
ROW_NAMES = tuple(name for name, _ in ROWS)


def get_config(arg: str = "naive_grpo,tiny") -> ml_collections.ConfigDict:
    row, _, scale = arg.partition(",")
    if row not in ROW_NAMES:
        raise ValueError(f"unknown ablation row {row!r}; choose from {ROW_NAMES}")
    scale = scale or "tiny"
    c, reference = grpo.get_config(scale), dapo.get_config(scale)
    for _, keys in ROWS[:ROW_NAMES.index(row) + 1]:
        for key, value in keys.items():
            section, field = key.split(".")
            c[section][field] = reference[section][field] if value is DAPO else value
    return c

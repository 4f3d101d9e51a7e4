"""The DAPO paper's ablation table (spec section 9) as data: each row adds one technique to the
row above, from naive GRPO to full DAPO. One argument picks the row and the scale:

    python -m dapo_jax.train --config=configs/ablation.py:clip_higher,tiny --workdir=runs/clip_higher
"""

import ml_collections

from configs import grpo

# (row, overrides added by this row), in the table's order; each row keeps the rows above it.
# The paper drops the KL term for every row (its section 2.3) and the recipe's dual clip c = 10
# is on throughout, so the last row is configs/dapo.py's algorithm.
ROWS = (
    ("naive_grpo", {"loss.beta": 0.0, "reference.path": "", "loss.clip_ratio_c": 10.0}),
    ("overlong_filter", {"reward.overlong_filter": True}),
    ("clip_higher", {"loss.eps_high": 0.28}),
    ("soft_overlong", {"reward.overlong_penalty": True}),
    ("token_level_loss", {"loss.agg_mode": "token-mean"}),
    ("dynamic_sampling", {"filter.enable": True, "filter.max_num_gen_batches": 4}),
)
ROW_NAMES = tuple(name for name, _ in ROWS)


def get_config(arg: str = "naive_grpo,tiny") -> ml_collections.ConfigDict:
    row, _, scale = arg.partition(",")
    if row not in ROW_NAMES:
        raise ValueError(f"unknown ablation row {row!r}; choose from {ROW_NAMES}")
    c = grpo.get_config(scale or "tiny")
    for name, overrides in ROWS[:ROW_NAMES.index(row) + 1]:
        for key, value in overrides.items():
            section, field = key.split(".")
            c[section][field] = value
    return c

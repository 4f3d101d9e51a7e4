"""Naive GRPO, the baseline the DAPO paper starts from: the first row of its ablation table
(docs/dapo_spec.md section 9), and the one definition of it (`configs/ablation.py:naive_grpo,SCALE` is this).

    python -m dapo_jax.train --config=configs/grpo.py:tiny --workdir=runs/grpo_tiny

What the paper states for it, against configs/dapo.py: a symmetric clip ε_low = ε_high = 0.2,
the sample-level loss (seq-mean-token-mean), no overlong filtering or punishment, no dynamic
sampling (every generated group is trained on). What it leaves open, and what we take:
  - KL: none (β = 0, no reference model). The table only ever adds techniques and ends at DAPO,
    which drops the KL term (the paper's section 2.3), so its first row has none either. A GRPO
    with KL is `--config.loss.beta=0.001 --config.reference.path=<the base model>`.
  - dual clip: on, c = 10, as configs/dapo.py. verl's actor applies it to every run (default
    c = 3) and no row of the table adds it.
  - everything else (lr and warm-up, batch and mini-batch sizes, G, lengths, sampling) is
    configs/dapo.py's at the same scale; a generation batch is one train batch of prompts.
"""

import ml_collections

from configs import dapo


def get_config(arg: str = "tiny") -> ml_collections.ConfigDict:
    return naive_grpo(dapo.get_config(arg))


def naive_grpo(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """A DAPO config turned into naive GRPO (the module docstring says which keys and why)."""
    c.loss.eps_high = c.loss.eps_low  # symmetric clip
    c.loss.agg_mode = "seq-mean-token-mean"  # sample-level loss
    c.reward.overlong_penalty = False
    c.reward.overlong_filter = False
    c.filter.enable = False  # every group is trained on, as it comes
    c.filter.gen_batch_prompts = c.train.train_batch_prompts
    c.filter.max_num_gen_batches = 1
    return c

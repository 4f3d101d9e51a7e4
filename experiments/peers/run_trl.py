"""TRL's GRPOTrainer (loss_type "dapo") on the reference workload, torch on CPU, f32.

    /work/peers/trl/bin/python experiments/peers/run_trl.py SPEC.json

A step is timed from the trainer's on_step_begin to its on_step_end callback (generation, loss,
backward, clipping, AdamW; logging comes after); generation is its
`_generate_and_score_completions` (sampling, rewards, advantages), the update the rest.
"""

import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import datasets  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
import trl  # noqa: E402
import workload  # noqa: E402


class StepCallback(transformers.TrainerCallback):
    """Times each optimizer step from on_step_begin to on_step_end into a `workload.StepTimer`."""

    def __init__(self, timer: workload.StepTimer):
        self.timer = timer

    def on_step_begin(self, args, state, control, **kwargs):
        self.timer.begin()

    def on_step_end(self, args, state, control, **kwargs):
        self.timer.end()


def time_trainer(trainer) -> workload.StepTimer:
    """A timer of `trainer`'s steps, its `_generate_and_score_completions` as the generation."""
    timer = workload.StepTimer()
    trainer._generate_and_score_completions = timer.wrap_generation(  # pylint: disable=protected-access
        trainer._generate_and_score_completions,  # pylint: disable=protected-access
        tokens=lambda out: int(out["completion_mask"].sum()),
    )
    trainer.add_callback(StepCallback(timer))
    return timer


def main():
    spec = workload.read_spec(sys.argv[1])
    torch.set_num_threads(spec["threads"])
    torch.manual_seed(spec["seed"])
    tokenizer = transformers.PreTrainedTokenizerFast.from_pretrained(spec["model_dir"])
    tokenizer.padding_side = "left"
    workload.check_round_trip(tokenizer)
    model = transformers.AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32)
    n, g = len(spec["prompts"]), spec["group_size"]
    args = trl.GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="bench_trl_"),
        loss_type="dapo",
        epsilon=0.2,
        epsilon_high=0.28,
        beta=0.0,
        num_generations=g,
        per_device_train_batch_size=n * g,
        gradient_accumulation_steps=1,
        num_iterations=1,
        max_completion_length=spec["max_new_tokens"],
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        scale_rewards="group",
        mask_truncated_completions=False,
        learning_rate=spec["lr"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=spec["weight_decay"],
        max_grad_norm=spec["grad_clip"],
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_epsilon=1e-8,
        max_steps=spec["warmup"] + spec["steps"],
        gradient_checkpointing=False,  # GRPOConfig defaults to True; ours does not recompute
        use_cpu=True,
        bf16=False,
        fp16=False,
        report_to="none",
        save_strategy="no",
        eval_strategy="no",
        logging_steps=1,
        log_completions=False,
        dataloader_num_workers=0,
        seed=spec["seed"],
    )
    trainer = trl.GRPOTrainer(
        model=model,
        reward_funcs=workload.reward,
        args=args,
        train_dataset=datasets.Dataset.from_dict({"prompt": spec["prompts"]}),
        processing_class=tokenizer,
    )
    timer = time_trainer(trainer)
    trainer.train()
    settings = {
        "version": f"trl {trl.__version__}, transformers {transformers.__version__}, "
        f"torch {torch.__version__}",
        "dtype": f"{next(model.parameters()).dtype} params and compute",
        "threads": torch.get_num_threads(),
        "optim": str(args.optim),
        "attn_implementation": model.config._attn_implementation,  # pylint: disable=protected-access
        "config": "GRPOConfig(loss_type=dapo, epsilon 0.2/0.28, beta 0, num_generations 8, "
        "batch 64, grad accumulation 1, num_iterations 1)",
    }
    workload.emit("trl", spec, timer.steps, settings)


if __name__ == "__main__":
    main()

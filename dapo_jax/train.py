"""The DAPO training run: `python -m dapo_jax.train --config=configs/dapo.py:tiny --workdir=DIR`.

One step (docs/dapo_spec.md sections 1-5; the README draws it):
  1. dynamic sampling: generation batches of `gen_batch_prompts` prompts x G responses (sampler on
     the policy's own sharded params), decoded, scored, overlong-shaped, until `train_batch_prompts`
     groups with mixed correctness are kept (or the bound is hit: missing groups are masked);
  2. A_i = group-relative advantages of the shaped rewards R_i;
  3. log pi_old (and log pi_ref when β > 0) once, then `train_batch / mini_batch` AdamW updates;
  4. metrics (console, JSONL, TensorBoard), a checkpoint and an evaluation on their schedules.

A run resumes by itself from the newest checkpoint in its workdir that restores (a damaged newer
one is skipped with a warning), and a resumed run continues exactly as the uninterrupted one would
have: the step's PRNG key is derived from the seed and the step, and the data order and the
filter's carried groups are in the checkpoint. SIGTERM (TPU preemption) to any process stops
every process of the run within seconds, abandoning the step in flight, with exit status 75
(`PREEMPTED`, EX_TEMPFAIL: `preemption`), so that a supervisor or requeue script tells a
preempted run (restart it: it resumes from the last checkpoint) from a finished one (0), a bad
config (2) and a crash (1); checkpoints come every `checkpoint.every` steps and every
`checkpoint.every_minutes` of wall clock. After each generation batch the processes check that
they agree on the rewards and the kept groups (`hosts.check_agreed`). When another process dies,
JAX's coordination service ends the survivors within `--heartbeat_timeout` seconds with a message
naming it (`hosts.peer_failure` says so first where a collective fails with an error) instead of
leaving them hanging in a collective; relaunching all of them resumes from the last complete
checkpoint. A non-finite loss or gradient skips the update; `max_consecutive_nonfinite` of them
in a row stop the run with a checkpoint of the last good state.
Run it from the repository root (the config files import `configs.common`).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import time

import jax
import ml_collections
import numpy as np
import tqdm
from absl import logging

from dapo_jax import (
    assembly,
    checkpoint,
    data,
    dynamic_sampling,
    evaluation,
    hf_io,
    hf_save,
    hosts,
    hub,
    metrics,
    packing,
    paths,
    preemption,
    programs,
    rollout,
    rollout_correction,
    sharding,
    step_metrics,
    train_step,
)
from dapo_jax.config_checks import check_config, check_workdir, profile_steps
from dapo_jax.records import TrainBatch
from dapo_jax.run import ConfigError, Run, build, make_filter

PREEMPTED = preemption.PREEMPTED  # exit status of a preempted run (EX_TEMPFAIL: requeue me)


def evaluate(run: Run, params, step: int, sample_rows: list | None = None, ks=None) -> dict:
    """Held-out avg@k / pass@k / maj@k of `params` with the config's eval settings; also
    `python -m dapo_jax.evaluate`'s, which passes `sample_rows` and `ks`."""
    t0 = time.time()
    result = rollout.evaluate(
        run.eval_sampler,
        run.rollout_weights(params),
        run.eval_examples,
        run.config.eval.samples,
        jax.random.fold_in(jax.random.key(run.config.seed + 1), step),
        tokenizer=run.tokenizer,
        scorer=run.scorer,
        prompt_len=run.config.data.max_prompt_len,
        batch_prompts=run.config.eval.batch_prompts,
        sample_rows=sample_rows,
        ks=ks,
    )
    result["timing/eval_s"] = time.time() - t0
    return result


def export_hf(run: Run, params, out: str | None = None, dtype: str | None = None) -> str:
    """`params` as a Hugging Face model directory (`hf_save.save_model`), by default the
    workdir's `export/` in `export.dtype`; also `python -m dapo_jax.export`'s."""
    c = run.config
    out = out or str(paths.run_path(run.workdir) / "export")
    return hf_save.save_model(
        params,
        run.hf_config,
        run.tokenizer,
        c.model.path,
        out,
        dtype or c.export.dtype,
        c.export.max_shard_bytes,
    )


@contextlib.contextmanager
def _trace(workdir: str, step: int, steps: set[int]):
    """A jax.profiler trace of the step into <workdir>/profile/step_<N> when it is in `steps`
    (TensorBoard's profile plugin or Perfetto read it)."""
    if step not in steps:
        yield
        return
    jax.profiler.start_trace(os.path.join(workdir, "profile", f"step_{step}"))
    try:
        yield
    finally:
        jax.profiler.stop_trace()


def _restore_or_start(
    run: Run,
    ckpt: checkpoint.Checkpointer,
    prompts: data.PromptIterator,
    filt: dynamic_sampling.DynamicSampler,
) -> tuple[int, train_step.TrainState, int]:
    """The newest checkpoint that restores (its state, and the data order and the filter's
    carry restored into `prompts` and `filt`), or the base model. Returns (last completed step,
    train state, non-finite updates in a row)."""
    c = run.config
    restored = ckpt.restore_latest(run.abstract_state())
    if restored is None:
        params = hf_io.load_params(c.model.path, run.model, run.mesh)
        return 0, train_step.init_train_state(run.model, run.optimizer, run.mesh, params), 0
    start, state, host = restored
    if int(host["seed"]) != c.seed:
        raise ConfigError(f"{run.workdir} holds a run with seed {int(host['seed'])}, not {c.seed}")
    prompts.restore(host["data"])
    filt.restore(host["filter"])
    print(f"resumed from {ckpt.directory} at step {start}", flush=True)
    return start, state, int(host["nonfinite_run"])


def _sample_train_batch(
    run: Run, params, prompts: data.PromptIterator, filt: dynamic_sampling.DynamicSampler, step: int
) -> tuple[TrainBatch, dict]:
    """Dynamic sampling: generation batches into `filt` until it is full or its bound is hit.
    Generation batch i of `step` samples with the key (seed, step, i), so that a resumed run
    draws exactly what the uninterrupted one did."""
    c = run.config
    with tqdm.tqdm(
        total=c.filter.max_num_gen_batches,
        desc=f"rollout {step}",
        unit="gen batch",
        leave=False,
        disable=None,
    ) as progress:
        for i in itertools.count():
            if filt.full or filt.bound_reached:
                break
            rng = jax.random.fold_in(jax.random.fold_in(jax.random.key(c.seed), step), i)
            batch = rollout.generation_batch(
                run.sampler,
                params,
                prompts.next_batch(c.filter.gen_batch_prompts),
                c.rollout.group_size,
                rng,
                tokenizer=run.tokenizer,
                scorer=run.scorer,
                prompt_len=c.data.max_prompt_len,
                shaping=run.shaping,
            )
            filt.add(batch)
            hosts.check_agreed(
                f"step {step}, generation batch {i + 1}",
                {
                    "rewards": batch.reward_B,
                    "kept groups": filt.kept_P,
                    "generation-batch count": np.array([i + 1, filt.full, filt.bound_reached]),
                },
            )
            progress.update()
    return filt.take()


def _step(
    run: Run,
    state: train_step.TrainState,
    prompts: data.PromptIterator,
    filt: dynamic_sampling.DynamicSampler,
    step: int,
) -> tuple[train_step.TrainState, dict, TrainBatch]:
    """One DAPO step: sample and filter, advantages, log pi_old (recomputed, or the sampler's:
    `loss.old_logp`), the updates; (state, metrics, the train batch)."""
    c = run.config
    t0 = time.time()
    batch, filter_stats = _sample_train_batch(run, run.rollout_weights(state.params), prompts, filt, step)
    t_rollout = time.time() - t0
    a = assembly.assemble(batch, c, run.mesh)
    host, device = a.host, a.device
    t1 = time.time()
    sampler_logp = lambda: a.sampler_logp(batch, run.mesh)
    recompute = c.loss.old_logp == "recompute"
    if recompute:
        old_logp_BxT = run.logprobs_fn(state.params, device.tokens_BxT, device.mask_BxT)
    else:
        old_logp_BxT = sampler_logp()
    device, is_weight_BxT, correction = _corrected(run, sampler_logp, device, old_logp_BxT)
    state, updates = train_step.train_on_rollout(
        run.train_step,
        run.logprobs_fn,
        run.mesh,
        state,
        device,
        c.train.train_batch_prompts // c.train.mini_batch_prompts,
        ref_params=run.ref_params,
        old_logp_BxT=old_logp_BxT,
        is_weight_BxT=is_weight_BxT,
    )
    updates = jax.device_get(updates)
    t_train = time.time() - t1
    if recompute:
        agreement = step_metrics.logp_agreement(
            batch.rows.logp_BxN,
            a.prompt_width,
            packing.unpack(a.layout, sharding.to_host(old_logp_BxT)),
            host.loss_mask_BxT,
            batch.carried_B,
        )
    else:  # the first update's params are the sampler's: its rows check the sampler
        agreement = {f"rollout/{k}": float(updates[0][k]) for k in ("logp_diff_mean", "logp_diff_max")}
    seconds = {"rollout": t_rollout, "train": t_train, "step": time.time() - t0}
    out = {
        **step_metrics.data_metrics(batch),
        **filter_stats,
        **agreement,
        **correction,
        **step_metrics.actor_metrics(updates),
    }
    return state, {**out, **step_metrics.speed_metrics(batch, host, seconds, run.scorer.totals)}, batch


_correct = jax.jit(rollout_correction.correct, static_argnums=0)


def _corrected(run: Run, sampler_logp, device: train_step.Rollout, old_logp_BxT):
    """`(rollout, is_weight_BxT, metrics)` under loss.rollout_is / loss.rollout_rs: the rollout's
    loss mask with the rejected tokens out, the IS weights pi_old / pi_sampler (None without
    rollout_is) and the rollout_corr/* metrics (`rollout_correction.correct`); without a
    correction the rollout unchanged, None and no metrics. `sampler_logp()`: the sampler's
    log-probs on the device, in the trained layout."""
    cfg = programs.loss_config(run.config)
    if not cfg.corrects:
        return device, None, {}
    with sharding.activate(run.mesh):
        corr = _correct(cfg, old_logp_BxT, sampler_logp(), device.loss_mask_BxT)
    weight_BxT = corr.is_weight_BxT if cfg.rollout_is else None
    metrics = {k: float(v) for k, v in jax.device_get(corr.metrics).items()}
    return device._replace(loss_mask_BxT=corr.loss_mask_BxT), weight_BxT, metrics


def completion_records(
    batch: TrainBatch, examples_by_problem: dict, group_size: int, m: ml_collections.ConfigDict
) -> list[dict]:
    """The first response of each of the first `m.completions_rows` real groups of the train
    batch, readable (`rollout.sample_records`, the last `m.completions_chars` characters)."""
    rows = np.flatnonzero(batch.valid_B)[::group_size][: m.completions_rows]
    examples = [examples_by_problem[int(batch.rows.problem_id_B[b])] for b in rows]
    return rollout.sample_records(batch.rows, examples, rows, m.completions_chars)


def train(c: ml_collections.ConfigDict, workdir: str, checkpoint_dir: str | None = None) -> dict:
    """Run (or resume) the configured training in `workdir` (checkpoints in `checkpoint_dir`,
    default `workdir/checkpoints`); returns the last step's metrics (with `export_dir` when this
    call trained). Hub ids in `c` resolve to cached folders first. A SIGTERM from here on stops
    the process (and every other of the run) with status 75 (`preemption`)."""
    c = hub.resolve_config(c)
    check_config(c)
    check_workdir(workdir)
    paths.run_path(workdir).mkdir(parents=True, exist_ok=True)  # gs:// stays a URL
    before_exit = []
    watcher = preemption.Preemption(before_exit)
    try:
        run = build(c, workdir)
        ckpt = checkpoint.Checkpointer(workdir, keep=c.checkpoint.keep, directory=checkpoint_dir)
        before_exit.append(ckpt.wait)  # a save in flight completes, where it can in the grace time
        try:
            return _train(run, ckpt)
        except jax.errors.JaxRuntimeError as e:
            if jax.process_count() > 1:
                hosts.peer_failure(e, run.scorer.close)
            raise
        finally:
            ckpt.close()
            run.scorer.close()
    finally:
        watcher.close()


def _train(run: Run, ckpt: checkpoint.Checkpointer) -> dict:
    """`train`'s loop: restore, the step-0 evaluation, the steps with their metrics and
    checkpoints (every `checkpoint.every` steps, at the end, after `checkpoint.every_minutes`,
    and before a stop for non-finite updates), then the export."""
    c, workdir = run.config, run.workdir
    prompts, filt = data.PromptIterator(run.train_examples, c.seed), make_filter(c)
    examples_by_problem = {ex["problem_id"]: ex for ex in run.train_examples}
    start, state, nonfinite_run = _restore_or_start(run, ckpt, prompts, filt)
    writer = _metrics_writer(c, workdir, start)
    profiled = profile_steps(c.profile.steps)
    clock = preemption.ClockCadence(c.checkpoint.every_minutes)
    summary = {}
    if start == 0 and c.eval.at_start and run.eval_examples:
        summary = evaluate(run, state.params, 0)
        writer.write(0, summary)
        print(f"step     0  held-out {evaluation.summary_text(summary)}", flush=True)
    for step in range(start + 1, c.train.steps + 1):
        with _trace(workdir, step, profiled):
            state, summary, batch = _step(run, state, prompts, filt, step)
        skipped = summary["actor/skipped_updates"]
        nonfinite_run = nonfinite_run + skipped if skipped else 0
        if skipped:
            logging.warning("step %d: %d update(s) skipped: non-finite loss or gradient", step, skipped)
        _record(run, writer, state, step, summary, batch, examples_by_problem)
        stop = nonfinite_run >= c.train.max_consecutive_nonfinite
        if step % c.checkpoint.every == 0 or step == c.train.steps or stop or clock.due():
            extras = {"seed": np.int64(c.seed), "data": prompts.state(), "filter": filt.state()}
            ckpt.save(step, state, {**extras, "nonfinite_run": np.int64(nonfinite_run)})
            clock.saved()
        if stop:
            raise FloatingPointError(
                f"step {step}: {nonfinite_run} updates in a row had a non-finite loss or "
                f"gradient; the last good state is checkpointed in {ckpt.directory}"
            )
    writer.close()
    if c.train.steps > start or not _exported(workdir):  # also an export cut by a preemption
        summary["export_dir"] = export_hf(run, state.params)
    return summary


def _exported(workdir: str) -> bool:
    """Whether the workdir's export/ is complete: its config.json (written after every shard)
    and its tokenizer (after that); process 0's answer on every process (whose workdirs may be
    folders of their own disks)."""
    export = paths.run_path(workdir) / "export"
    done = (export / "config.json").exists() and (export / "tokenizer_config.json").exists()
    return hosts.allgather_json(done)[0]


def _metrics_writer(c: ml_collections.ConfigDict, workdir: str, start: int) -> metrics.MetricsWriter:
    """The run's metrics writer, appending after `start` when resuming."""
    m = c.metrics
    return metrics.MetricsWriter(
        workdir,
        resume_step=start or None,
        writers=m.writers,
        wandb_project=m.wandb_project,
        aliases=m.aliases,
        config=c.to_dict(),
    )


def _record(
    run: Run,
    writer: metrics.MetricsWriter,
    state: train_step.TrainState,
    step: int,
    summary: dict,
    batch: TrainBatch,
    examples_by_problem: dict,
) -> None:
    """Evaluate when due (into `summary`), then write the step's metrics, its sampled completions
    when due, and its console line."""
    c = run.config
    if c.eval.every and run.eval_examples and (step % c.eval.every == 0 or step == c.train.steps):
        summary.update(evaluate(run, state.params, step))
    writer.write(step, summary)
    if c.metrics.completions_every and step % c.metrics.completions_every == 0:
        records = completion_records(batch, examples_by_problem, c.rollout.group_size, c.metrics)
        writer.write_completions(step, records)
    print(metrics.console_line(step, summary), flush=True)


if __name__ == "__main__":
    from dapo_jax import cli  # noqa: PLC0415 - the command line, not the library

    cli.run(cli.train_main)

"""Run metrics to `<workdir>/metrics.jsonl`, TensorBoard event files, optionally Weights & Biases,
and as a console line.

`metrics.writers` picks them: "jsonl,tensorboard" (default) and "wandb" (optional package
`wandb`, extra `tracking`; `WANDB_MODE=offline` writes under `<workdir>/wandb` without an account).
Only process 0 writes. On resume the records past the restored step are dropped from the JSONL
file and purged from TensorBoard, so the curves of a resumed run have no duplicated steps; the
wandb run keeps its id (`<workdir>/wandb_run_id`) and resumes, and wandb ignores steps it has.
With `metrics.aliases`, wandb gets the reference recipe's names (`RECIPE_NAMES`, verl's DAPO
recipe at 4f80e465) for the quantities that both log, so the curves overlay its public runs.
Every file goes through `dapo_jax.paths` (etils.epath), so a `gs://` workdir works unchanged: the
JSONL file is rewritten whole at each step (object stores cannot append; a run's file is small);
wandb's own files stay on local disk.
"""

from __future__ import annotations

import json
import math
import uuid

import jax

from dapo_jax import paths

JSONL = "metrics.jsonl"
COMPLETIONS = "completions.jsonl"  # tables of sampled completions, every metrics.completions_every steps
WRITERS = ("jsonl", "tensorboard", "wandb")

# Our key -> the recipe's name for the same quantity (verl's compute_data_metrics, dp_actor and
# the DAPO trainer). Its critic/* and response_length/* are over the train batch (after the
# filter): our data/*. Its actor/pg_clipfrac_lower is the dual-clip fraction, so ours of that
# name (clipped at 1 - ε_low) is renamed; its actor/pg_clipfrac (clipped at either bound) is
# the sum of our upper and lower fractions (`recipe_names`). Its actor/ppo_kl is the k1
# estimator, our approx_kl_old the k3 one: not aliased.
RECIPE_NAMES = {
    "data/score_mean": "critic/score/mean",
    "data/reward_mean": "critic/rewards/mean",
    "data/response_length_mean": "response_length/mean",
    "data/response_length_max": "response_length/max",
    "data/response_length_min": "response_length/min",
    "data/truncated_fraction": "response_length/clip_ratio",
    "actor/pg_clipfrac_dual": "actor/pg_clipfrac_lower",
    "actor/pg_clipfrac_lower": "actor/pg_clipfrac_eps_low",
    "actor/learning_rate": "actor/lr",
    "dynamic_sampling/gen_batches": "train/num_gen_batches",
    "timing/step_s": "timing_s/step",
    "timing/rollout_s": "timing_s/gen",
}


def recipe_names(metrics: dict) -> dict:
    """`metrics` under the recipe's names where it has one (`RECIPE_NAMES`), plus its
    actor/pg_clipfrac = upper + lower clip fraction (disjoint: A > 0 and A < 0 tokens)."""
    out = {RECIPE_NAMES.get(k, k): v for k, v in metrics.items()}
    if "actor/pg_clipfrac_upper" in metrics and "actor/pg_clipfrac_lower" in metrics:
        out["actor/pg_clipfrac"] = metrics["actor/pg_clipfrac_upper"] + metrics["actor/pg_clipfrac_lower"]
    return out


# The console line: (metric key, label, format), docs/dapo_spec.md section 10's headline figures. Accuracy
# and score are the policy's, over every sampled response (before the dynamic-sampling filter).
CONSOLE = (
    ("before_filter/acc_mean", "acc", ".3f"),
    ("before_filter/score_mean", "score", "+.3f"),
    ("before_filter/length_mean", "len", ".1f"),
    ("actor/entropy", "ent", ".3f"),
    ("actor/token_prob", "p", ".3f"),
    ("actor/pg_clipfrac_upper", "clip+", ".3f"),
    ("dynamic_sampling/kept_fraction", "kept", ".2f"),
    ("timing/step_s", "s", ".1f"),
)


def read_jsonl(path) -> list[dict]:
    """Records of a metrics.jsonl file (a local path or a URL); a line cut short by a killed run
    is ignored."""
    records = []
    for line in paths.run_path(path).read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def console_line(step: int, metrics: dict) -> str:
    parts = [f"step {step:5d}"]
    for key, label, fmt in CONSOLE:
        if key in metrics:
            parts.append(f"{label} {metrics[key]:{fmt}}")
    parts += [
        f"held-out {key[len('eval/') :]} {value:.3f}"
        for key, value in metrics.items()
        if key.startswith("eval/avg@")
    ]
    return "  ".join(parts)


def _tensorboard(root, purge: int | None):
    """tensorboardX's writer under `root/tensorboard`, its events past `purge` dropped; imported
    only when asked for (`paths.tensorboard_writers` says why)."""
    import tensorboardX  # noqa: PLC0415

    paths.tensorboard_writers()
    return tensorboardX.SummaryWriter(str(root / "tensorboard"), purge_step=purge)


class MetricsWriter:
    """JSONL + TensorBoard (+ wandb) writer of scalar dicts, one record per step."""

    def __init__(
        self,
        workdir: str,
        *,
        resume_step: int | None = None,
        writers: str = "jsonl,tensorboard",
        wandb_project: str = "dapo-jax",
        aliases: bool = False,
        config: dict | None = None,
    ):
        self.enabled = jax.process_index() == 0
        if not self.enabled:
            return
        names = parse_writers(writers)
        root = paths.run_path(workdir)
        root.mkdir(parents=True, exist_ok=True)
        self._jsonl = _JsonlLog(root / JSONL, resume_step)
        self._completions = _JsonlLog(root / COMPLETIONS, resume_step)
        purge = None if resume_step is None else resume_step + 1
        self._tb = _tensorboard(root, purge) if "tensorboard" in names else None
        self._aliases = aliases
        self._wandb = _start_wandb(workdir, wandb_project, config) if "wandb" in names else None

    def write(self, step: int, metrics: dict) -> None:
        if not self.enabled:
            return
        scalars = {k: float(v) for k, v in metrics.items()}
        finite = {k: v for k, v in scalars.items() if math.isfinite(v)}
        if self._tb is not None:
            for key, value in finite.items():
                self._tb.add_scalar(key, value, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(recipe_names(finite) if self._aliases else finite, step=step)
        record = {"step": step, **{k: (v if math.isfinite(v) else str(v)) for k, v in scalars.items()}}
        self._jsonl.append([record])

    def write_completions(self, step: int, records: list[dict]) -> None:
        """A table of sampled completions (`rollout.sample_records`) to `<workdir>/completions.jsonl`,
        each record with its step, and to wandb as a table."""
        if not self.enabled or not records:
            return
        self._completions.append([{"step": step, **r} for r in records])
        if self._wandb is not None:
            import wandb  # pylint: disable=import-outside-toplevel  # optional: extra `tracking`

            columns = list(records[0])
            table = wandb.Table(columns=columns, data=[[r[k] for k in columns] for r in records])
            self._wandb.log({"completions": table}, step=step)

    def close(self) -> None:
        if self.enabled:
            if self._tb is not None:
                self._tb.close()
            if self._wandb is not None:
                self._wandb.finish()


class _JsonlLog:
    """A JSONL file of records that have a `step`, rewritten whole at each append (an object store
    cannot append); the records past `resume_step` of an existing file are dropped."""

    def __init__(self, path, resume_step: int | None):
        self.path = path
        self._lines = []  # the file's records, as its lines
        if path.exists():
            self._lines = [
                json.dumps(r) + "\n"
                for r in read_jsonl(path)
                if resume_step is None or r["step"] <= resume_step
            ]

    def append(self, records: list[dict]) -> None:
        self._lines += [json.dumps(r) + "\n" for r in records]
        paths.write_text_atomic(self.path, "".join(self._lines))


def parse_writers(writers: str) -> tuple[str, ...]:
    """The writer names of "jsonl,tensorboard[,wandb]"; ValueError for an unknown one, or
    without jsonl (resume, plots and reports read metrics.jsonl)."""
    names = tuple(w.strip() for w in writers.split(",") if w.strip())
    unknown = [w for w in names if w not in WRITERS]
    if unknown or "jsonl" not in names:
        raise ValueError(
            f"metrics.writers {writers!r}: a comma-separated list of {WRITERS} that includes jsonl"
        )
    return names


def _start_wandb(workdir: str, project: str, config: dict | None):
    """A wandb run whose id is kept in the workdir (`wandb_run_id`), so that a resumed training
    run logs into the same wandb run; its local files under `<workdir>/wandb` (wandb's default
    folder when the workdir is a URL)."""
    import wandb  # pylint: disable=import-outside-toplevel  # optional: extra `tracking`

    root = paths.run_path(workdir)
    id_file = root / "wandb_run_id"
    if id_file.is_file():
        run_id = id_file.read_text().strip()
    else:
        run_id = uuid.uuid4().hex[:12]
        paths.write_text_atomic(id_file, run_id)
    return wandb.init(
        project=project,
        name=root.name,
        id=run_id,
        resume="allow",
        dir=None if paths.is_url(workdir) else workdir,
        config=config,
    )

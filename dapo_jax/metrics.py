"""Run metrics to TensorBoard event files, to `<workdir>/metrics.jsonl` and as a console line.

Only process 0 writes. On resume the records past the restored step are dropped from the JSONL
file and purged from TensorBoard, so the curves of a resumed run have no duplicated steps. Every
file goes through `dapo_jax.paths` (etils.epath), so a `gs://` workdir works unchanged: the JSONL
file is rewritten whole at each step (object stores cannot append; a run's file is small).
"""

from __future__ import annotations

import json
import math

import jax
import tensorboardX

from dapo_jax import paths

JSONL = "metrics.jsonl"

# The console line: (metric key, label, format), spec section 10's headline figures. Accuracy
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
    parts += [f"held-out {key[len('eval/'):]} {value:.3f}" for key, value in metrics.items()
              if key.startswith("eval/avg@")]
    return "  ".join(parts)


class MetricsWriter:
    """TensorBoard + JSONL writer of scalar dicts, one record per step."""

    def __init__(self, workdir: str, *, resume_step: int | None = None):
        self.enabled = jax.process_index() == 0
        if not self.enabled:
            return
        root = paths.run_path(workdir)
        root.mkdir(parents=True, exist_ok=True)
        self.path = root / JSONL
        self._lines = []  # the file's records, as its lines
        if self.path.exists():
            self._lines = [json.dumps(r) + "\n" for r in read_jsonl(self.path)
                           if resume_step is None or r["step"] <= resume_step]
        purge = None if resume_step is None else resume_step + 1
        paths.tensorboard_writers()
        self._tb = tensorboardX.SummaryWriter(str(root / "tensorboard"), purge_step=purge)

    def write(self, step: int, metrics: dict) -> None:
        if not self.enabled:
            return
        scalars = {k: float(v) for k, v in metrics.items()}
        for key, value in scalars.items():
            if math.isfinite(value):
                self._tb.add_scalar(key, value, step)
        record = {"step": step, **{k: (v if math.isfinite(v) else str(v)) for k, v in scalars.items()}}
        self._lines.append(json.dumps(record) + "\n")
        paths.write_text_atomic(self.path, "".join(self._lines))
        self._tb.flush()

    def close(self) -> None:
        if self.enabled:
            self._tb.close()

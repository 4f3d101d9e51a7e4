"""Run metrics to TensorBoard event files, to `<workdir>/metrics.jsonl` and as a console line.

Only process 0 writes. On resume the records past the restored step are dropped from the JSONL
file and purged from TensorBoard, so the curves of a resumed run have no duplicated steps.
"""

from __future__ import annotations

import json
import math
import os

import jax
import tensorboardX

JSONL = "metrics.jsonl"

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


def read_jsonl(path: str) -> list[dict]:
    """Records of a metrics.jsonl file; a line cut short by a killed run is ignored."""
    records = []
    with open(path) as f:
        for line in f:
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
        os.makedirs(workdir, exist_ok=True)
        self.path = os.path.join(workdir, JSONL)
        if resume_step is not None and os.path.exists(self.path):
            kept = [r for r in read_jsonl(self.path) if r["step"] <= resume_step]
            with open(self.path, "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in kept)
        purge = None if resume_step is None else resume_step + 1
        self._tb = tensorboardX.SummaryWriter(os.path.join(workdir, "tensorboard"), purge_step=purge)
        self._jsonl = open(self.path, "a")

    def write(self, step: int, metrics: dict) -> None:
        if not self.enabled:
            return
        scalars = {k: float(v) for k, v in metrics.items()}
        for key, value in scalars.items():
            if math.isfinite(value):
                self._tb.add_scalar(key, value, step)
        record = {"step": step, **{k: (v if math.isfinite(v) else str(v)) for k, v in scalars.items()}}
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        self._tb.flush()

    def close(self) -> None:
        if self.enabled:
            self._jsonl.close()
            self._tb.close()

#!/usr/bin/env bash
# On every worker of a pod slice, held-out evaluation of the run's checkpoint (the newest, or --step=N): the workers sample together, each scores 1/n of the responses; worker 0 writes metrics.json and samples.jsonl to --out (default WORKDIR/eval_step_N).
# `python -m dapo_jax.evaluate --multihost`, detached, through tpu_setup/worker.sh: logs in
# ~/dapo-logs/evaluate.log on each worker (tpu_setup/logs.sh --job=evaluate) and in WORKDIR/logs/.
# CONFIG is the run's, with the run's overrides (model.path among them).
# Usage: tpu_setup/evaluate.sh [--dry-run] NAME ZONE CONFIG WORKDIR [evaluate flags...]
#   e.g. tpu_setup/evaluate.sh dapo-v5p us-east5-a configs/dapo.py:qwen2_5_32b gs://bucket/run1 \
#          --config.model.path=../models/Qwen2.5-32B --step=200 --samples=32 --data=../data-dapo/aime-2024.parquet
set -euo pipefail
source "$(dirname "$0")/common.sh"
parse_flags "--dry-run" "$@"; shift "$NFLAGS"
if [ $# -lt 4 ]; then
  echo "usage: $(basename "$0") [--dry-run] NAME ZONE CONFIG WORKDIR [flags...]" >&2; exit 2
fi
start_job "$1" "$2" evaluate "${@:3}"

#!/usr/bin/env bash
# Start the same training command on every worker (JAX's multi-controller runtime: one process per
# host; jax.distributed finds the slice's coordinator by itself on Cloud TPU), detached, through
# tpu_setup/worker.sh: logs in ~/dapo-logs/train.log on each worker and in WORKDIR/logs/.
# Launching again after a preemption (exit status 75) resumes the run.
# Usage: tpu_setup/launch.sh [--dry-run] NAME ZONE CONFIG WORKDIR [trainer flags...]
#   e.g. tpu_setup/launch.sh dapo-v5p us-east5-a configs/dapo.py:qwen2_5_32b gs://bucket/run1 \
#          --config.model.path=/home/me/models/qwen2_5_32b --config.checkpoint.every_minutes=20
# Each flag reaches the trainer as one argument, whatever it holds (quotes, spaces, tuples).
# --dry-run prints the gcloud command.
set -euo pipefail
source "$(dirname "$0")/common.sh"
parse_flags "--dry-run" "$@"; shift "$NFLAGS"
if [ $# -lt 4 ]; then
  echo "usage: $(basename "$0") [--dry-run] NAME ZONE CONFIG WORKDIR [flags...]" >&2; exit 2
fi
start_job "$1" "$2" train "${@:3}"

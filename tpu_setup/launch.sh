#!/usr/bin/env bash
# Start the same training command on every worker (JAX's multi-controller runtime: one process per
# host; jax.distributed finds the slice's coordinator by itself on Cloud TPU), detached (nohup,
# stdin from /dev/null), through tpu_setup/worker.sh: logs in ~/dapo-logs/train.log on each worker
# and in WORKDIR/logs/. Launching again after a preemption (exit status 75) resumes the run.
# Usage: tpu_setup/launch.sh [--dry-run] NAME ZONE CONFIG WORKDIR [trainer flags...]
#   e.g. tpu_setup/launch.sh dapo-v5p us-east5-a configs/dapo.py:qwen2_5_32b gs://bucket/run1 \
#          --config.model.path=/home/me/models/qwen2_5_32b "--config.mesh.shape=(1, 64)"
# The redirections are the background command's own, so that ssh returns at once.
# Each flag reaches the trainer as one argument, whatever it holds (quotes, spaces, tuples): it is
# quoted again for the workers' shell. --dry-run prints the gcloud command.
set -euo pipefail
source "$(dirname "$0")/common.sh"
parse_flags "--dry-run" "$@"; shift "$NFLAGS"
if [ $# -lt 4 ]; then
  echo "usage: $(basename "$0") [--dry-run] NAME ZONE CONFIG WORKDIR [flags...]" >&2; exit 2
fi
NAME=$1 ZONE=$2 CONFIG=$3 WORKDIR=$4; shift 4
ARGS=$(quote_args "$WORKDIR" "--config=$CONFIG" --multihost "$@")
on_workers "$NAME" "$ZONE" all "cd $REMOTE_TREE || exit; nohup bash tpu_setup/worker.sh $ARGS \
>/dev/null 2>&1 </dev/null &"
if [ "$DRY_RUN" = 0 ]; then
  echo "started on every worker of $NAME; tpu_setup/logs.sh $NAME $ZONE shows worker 0's log"
fi

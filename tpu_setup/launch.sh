#!/usr/bin/env bash
# Start the same training command on every worker (JAX's multi-controller runtime: one process per
# host; jax.distributed discovers the slice's coordinator by itself on Cloud TPU).
# Usage: tpu_setup/launch.sh [--dry-run] NAME ZONE CONFIG WORKDIR [extra flags...]
#   e.g. tpu_setup/launch.sh dapo-v5p us-east5-a configs/dapo.py:qwen2_5_32b gs://bucket/run1
# --dry-run prints the gcloud command instead of running it. Each extra flag reaches the trainer
# as one argument, whatever it holds (quotes, spaces, tuples): it is quoted again for the
# workers' shell.
set -euo pipefail
DRY_RUN=0
if [ "${1:-}" = --dry-run ]; then DRY_RUN=1; shift; fi
if [ $# -lt 4 ]; then
  echo "usage: $0 [--dry-run] NAME ZONE CONFIG WORKDIR [flags...]" >&2; exit 2
fi
NAME=$1 ZONE=$2 CONFIG=$3 WORKDIR=$4; shift 4
ARGS=$(printf '%q ' "--config=$CONFIG" "--workdir=$WORKDIR" --multihost "$@")
# ~ is the worker's home (left unquoted for its shell); stdin closed so that nohup detaches.
REMOTE="cd ~/dapo-jax && nohup ~/dapo-venv/bin/python -m dapo_jax.train $ARGS\
> ~/dapo-train.log 2>&1 < /dev/null &"
CMD=(gcloud compute tpus tpu-vm ssh "$NAME" --zone="$ZONE" --worker=all --command="$REMOTE")
if [ "$DRY_RUN" = 1 ]; then printf '%q ' "${CMD[@]}"; echo; exit 0; fi
"${CMD[@]}"
echo "started on every worker of $NAME; logs in ~/dapo-train.log on each"

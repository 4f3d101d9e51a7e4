#!/usr/bin/env bash
# Start the same training command on every worker (JAX's multi-controller runtime: one process per
# host; jax.distributed discovers the slice's coordinator by itself on Cloud TPU).
# Usage: tpu_setup/launch.sh NAME ZONE CONFIG WORKDIR [extra flags...]
#   e.g. tpu_setup/launch.sh dapo-v5p us-east5-a configs/dapo.py:qwen2_5_32b gs://bucket/run1
set -euo pipefail
if [ $# -lt 4 ]; then echo "usage: $0 NAME ZONE CONFIG WORKDIR [flags...]" >&2; exit 2; fi
NAME=$1 ZONE=$2 CONFIG=$3 WORKDIR=$4; shift 4
gcloud compute tpus tpu-vm ssh "$NAME" --zone="$ZONE" --worker=all --command="
  cd ~/dapo-jax && nohup ~/dapo-venv/bin/python -m dapo_jax.train --config=$CONFIG \
    --workdir=$WORKDIR --multihost $* > ~/dapo-train.log 2>&1 &"
echo "started on every worker of $NAME; logs in ~/dapo-train.log on each"

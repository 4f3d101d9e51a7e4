#!/usr/bin/env bash
# On every worker of a pod slice, the run's checkpoint (the newest, or --step=N) as a Hugging Face folder: each worker writes its own safetensors shards into --out (default WORKDIR/export_step_N), so give a folder every worker sees (gs://...).
# `python -m dapo_jax.export --multihost`, detached, through tpu_setup/worker.sh: logs in
# ~/dapo-logs/export.log on each worker (tpu_setup/logs.sh --job=export) and in WORKDIR/logs/.
# CONFIG is the run's, with the run's overrides (model.path among them).
# Usage: tpu_setup/export.sh [--dry-run] NAME ZONE CONFIG WORKDIR [export flags...]
#   e.g. tpu_setup/export.sh dapo-v5p us-east5-a configs/dapo.py:qwen2_5_32b gs://bucket/run1 \
#          --config.model.path=../models/Qwen2.5-32B --step=200 --dtype=bfloat16
set -euo pipefail
source "$(dirname "$0")/common.sh"
parse_flags "--dry-run" "$@"; shift "$NFLAGS"
if [ $# -lt 4 ]; then
  echo "usage: $(basename "$0") [--dry-run] NAME ZONE CONFIG WORKDIR [flags...]" >&2; exit 2
fi
start_job "$1" "$2" export "${@:3}"

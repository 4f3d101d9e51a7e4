#!/usr/bin/env bash
# Create a TPU VM or pod slice, with the runtime of its generation (v5p: v2-alpha-tpuv5,
# v6e: v2-alpha-tpuv6e, v5e: v2-alpha-tpuv5-lite; RUNTIME overrides it).
# Usage: tpu_setup/create.sh [--dry-run] [--queued] [--spot | --reserved] NAME ZONE TYPE
#   e.g. tpu_setup/create.sh --queued --spot dapo-v5p us-east5-a v5p-64
# --queued asks for a queued resource (the way to get v5p/v6e capacity and Spot VMs) of the same
# name; without it the VM is created directly. --dry-run prints the gcloud command.
# A preempted run resumes from its last checkpoint; `delete` is what stops the bill.
set -euo pipefail
DRY_RUN=0 QUEUED=0 CAPACITY=()
while [ $# -gt 0 ]; do
  case $1 in
    --dry-run) DRY_RUN=1 ;;
    --queued) QUEUED=1 ;;
    --spot) CAPACITY=(--spot) ;;
    --reserved) CAPACITY=(--reserved) ;;
    *) break ;;
  esac
  shift
done
if [ $# -ne 3 ]; then
  echo "usage: $0 [--dry-run] [--queued] [--spot | --reserved] NAME ZONE TYPE" >&2; exit 2
fi
NAME=$1 ZONE=$2 TYPE=$3
case $TYPE in
  v5p-*) DEFAULT_RUNTIME=v2-alpha-tpuv5 ;;
  v6e-*) DEFAULT_RUNTIME=v2-alpha-tpuv6e ;;
  v5litepod-*|v5e-*) DEFAULT_RUNTIME=v2-alpha-tpuv5-lite ;;
  *) echo "$0: no default runtime for accelerator type $TYPE: set RUNTIME" >&2; exit 2 ;;
esac
RUNTIME=${RUNTIME:-$DEFAULT_RUNTIME}
if [ "$QUEUED" = 1 ]; then
  CMD=(gcloud compute tpus queued-resources create "$NAME" --node-id="$NAME" --zone="$ZONE"
       --accelerator-type="$TYPE" --runtime-version="$RUNTIME" "${CAPACITY[@]}")
else
  CMD=(gcloud compute tpus tpu-vm create "$NAME" --zone="$ZONE" --accelerator-type="$TYPE"
       --version="$RUNTIME" "${CAPACITY[@]}")
fi
if [ "$DRY_RUN" = 1 ]; then printf '%q ' "${CMD[@]}"; echo; exit 0; fi
"${CMD[@]}"

#!/usr/bin/env bash
# Create a TPU VM or pod slice, with the runtime of its generation (v5p: v2-alpha-tpuv5,
# v6e: v2-alpha-tpuv6e, v5e: v2-alpha-tpuv5-lite, per the Cloud TPU "TPU software versions"
# page; RUNTIME overrides it).
# Usage: tpu_setup/create.sh [--dry-run] [--queued] [--spot | --reserved | --on-demand] NAME ZONE TYPE
#   e.g. tpu_setup/create.sh --queued --spot dapo-v5p us-east5-a v5p-64
# --queued asks for a queued resource of the same name (the documented way to get v5p/v6e capacity
# and Spot VMs; it waits in the queue until granted, see status.sh); without it the VM is created
# directly. Capacity: on-demand (the default), Spot (preemptible, cheaper) or a reservation.
# --dry-run prints the gcloud command. delete.sh is what stops the bill.
set -euo pipefail
source "$(dirname "$0")/common.sh"
CAPACITY=()
own_flag() {
  case $1 in
    --spot | --reserved) CAPACITY=("$1") ;;
    --on-demand) CAPACITY=() ;;
  esac
}
parse_flags "--dry-run --queued --spot --reserved --on-demand" "$@"; shift "$NFLAGS"
expect_args 3 "[--dry-run] [--queued] [--spot | --reserved | --on-demand] NAME ZONE TYPE" "$@"
NAME=$1 ZONE=$2 TYPE=$3
case $TYPE in
  v5p-*) DEFAULT_RUNTIME=v2-alpha-tpuv5 ;;
  v6e-*) DEFAULT_RUNTIME=v2-alpha-tpuv6e ;;
  v5litepod-*|v5e-*) DEFAULT_RUNTIME=v2-alpha-tpuv5-lite ;;
  *) die "no default runtime for accelerator type $TYPE (v5p-N, v6e-N, v5litepod-N): set RUNTIME" ;;
esac
RUNTIME=${RUNTIME:-$DEFAULT_RUNTIME}
if [ "$QUEUED" = 1 ]; then
  run gcloud compute tpus queued-resources create "$NAME" --node-id="$NAME" --zone="$ZONE" \
    --accelerator-type="$TYPE" --runtime-version="$RUNTIME" "${CAPACITY[@]}"
else
  run gcloud compute tpus tpu-vm create "$NAME" --zone="$ZONE" --accelerator-type="$TYPE" \
    --version="$RUNTIME" "${CAPACITY[@]}"
fi

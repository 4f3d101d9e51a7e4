#!/usr/bin/env bash
# Delete the TPU VM / pod slice (and with --queued its queued resource): what stops the bill.
# Checkpoints and logs on a gs:// workdir stay; the workers' disks (staged weights) go.
# Usage: tpu_setup/delete.sh [--dry-run] [--queued] NAME ZONE
set -euo pipefail
source "$(dirname "$0")/common.sh"
parse_flags "--dry-run --queued" "$@"; shift "$NFLAGS"
expect_args 2 "[--dry-run] [--queued] NAME ZONE" "$@"
if [ "$QUEUED" = 1 ]; then  # --force deletes the granted node with its request
  run gcloud compute tpus queued-resources delete "$1" --zone="$2" --force --quiet
else
  run gcloud compute tpus tpu-vm delete "$1" --zone="$2" --quiet
fi

#!/usr/bin/env bash
# The state of the TPU VM (with --queued, of its queued resource: WAITING_FOR_RESOURCES,
# PROVISIONING, ACTIVE, ...) and of the run on every worker: running, or its exit status
# (0 finished, 75 preempted: launch again, other: failed), and the log's last line.
# Usage: tpu_setup/status.sh [--dry-run] [--queued] NAME ZONE
set -euo pipefail
source "$(dirname "$0")/common.sh"
parse_flags "--dry-run --queued" "$@"; shift "$NFLAGS"
expect_args 2 "[--dry-run] [--queued] NAME ZONE" "$@"
if [ "$QUEUED" = 1 ]; then
  run gcloud compute tpus queued-resources describe "$1" --zone="$2" --format='value(state.state)'
fi
run gcloud compute tpus tpu-vm describe "$1" --zone="$2" --format='value(state,health)'
on_workers "$1" "$2" all "L=$REMOTE_LOGS
if [ -f \$L/train.status ]; then S=\"exit status \$(cat \$L/train.status)\"
elif [ -f \$L/train.pid ] && kill -0 \"\$(cat \$L/train.pid)\" 2>/dev/null; then S=running
else S='no run'; fi
echo \"\$(hostname): \$S | \$(tail -n 1 \$L/train.log 2>/dev/null)\""

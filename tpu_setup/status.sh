#!/usr/bin/env bash
# The state of the TPU VM (with --queued, of its queued resource: WAITING_FOR_RESOURCES,
# PROVISIONING, ACTIVE, ...) and of the run on every worker: running, or its exit status
# (0 finished, 75 preempted: launch again, other: failed), and the log's last line; with
# --job=export / --job=evaluate, of export.sh's / evaluate.sh's run.
# Usage: tpu_setup/status.sh [--dry-run] [--queued] [--job=JOB] NAME ZONE
set -euo pipefail
source "$(dirname "$0")/common.sh"
JOB=train
own_flag() { JOB=${1#--job=}; }
parse_flags "--dry-run --queued --job=" "$@"; shift "$NFLAGS"
expect_args 2 "[--dry-run] [--queued] [--job=JOB] NAME ZONE" "$@"
case $JOB in train | export | evaluate) ;; *) die "--job=$JOB: give train, export or evaluate" ;; esac
if [ "$QUEUED" = 1 ]; then
  run gcloud compute tpus queued-resources describe "$1" --zone="$2" --format='value(state.state)'
fi
run gcloud compute tpus tpu-vm describe "$1" --zone="$2" --format='value(state,health)'
on_workers "$1" "$2" all "L=$REMOTE_LOGS
if [ -f \$L/$JOB.status ]; then S=\"exit status \$(cat \$L/$JOB.status)\"
elif [ -f \$L/$JOB.pid ] && kill -0 \"\$(cat \$L/$JOB.pid)\" 2>/dev/null; then S=running
else S='no run'; fi
echo \"\$(hostname): \$S | \$(tail -n 1 \$L/$JOB.log 2>/dev/null)\""

#!/usr/bin/env bash
# Stop the run on every worker as a preemption does: SIGTERM, after which every process stops
# within seconds, abandoning the step in flight, and exits with status 75 (launch.sh again
# resumes from the last checkpoint). The VMs keep running, and billing: delete.sh stops the bill.
# Usage: tpu_setup/stop.sh [--dry-run] NAME ZONE
set -euo pipefail
source "$(dirname "$0")/common.sh"
parse_flags "--dry-run" "$@"; shift "$NFLAGS"
expect_args 2 "[--dry-run] NAME ZONE" "$@"
# Only a pid that still runs dapo_jax.train (not a recycled one); -ww: the whole command line,
# not the first 80 columns (a long venv path would hide the module).
on_workers "$1" "$2" all "PID=\$(cat $REMOTE_LOGS/train.pid 2>/dev/null) &&
ps -ww -p \"\$PID\" -o args= | grep -q dapo_jax.train && kill -TERM \"\$PID\" &&
echo \"\$(hostname): SIGTERM sent to \$PID\" || echo \"\$(hostname): no run\""

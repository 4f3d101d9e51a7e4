#!/usr/bin/env bash
# Show the last lines of the log of one worker (0 by default), or follow it: the training's, or
# with --job=export / --job=evaluate that of export.sh's / evaluate.sh's run.
# Usage: tpu_setup/logs.sh [--dry-run] [--follow] [--worker=N] [--job=JOB] NAME ZONE
set -euo pipefail
source "$(dirname "$0")/common.sh"
WORKER=0 FOLLOW= JOB=train
own_flag() {
  case $1 in
    --job=*) JOB=${1#--job=} ;;
    --follow) FOLLOW=-F ;;
    --worker=*) WORKER=${1#--worker=} ;;
  esac
}
parse_flags "--dry-run --follow --worker= --job=" "$@"; shift "$NFLAGS"
expect_args 2 "[--dry-run] [--follow] [--worker=N] [--job=JOB] NAME ZONE" "$@"
case $JOB in train | export | evaluate) ;; *) die "--job=$JOB: give train, export or evaluate" ;; esac
case $WORKER in ''|*[!0-9]*) die "--worker=$WORKER: give a worker number (0, 1, ...)" ;; esac
on_workers "$1" "$2" "$WORKER" "tail -n 200 $FOLLOW $REMOTE_LOGS/$JOB.log"

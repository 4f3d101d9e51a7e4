#!/usr/bin/env bash
# Show the last lines of the training log of one worker (0 by default), or follow it.
# Usage: tpu_setup/logs.sh [--dry-run] [--follow] [--worker=N] NAME ZONE
set -euo pipefail
source "$(dirname "$0")/common.sh"
WORKER=0 FOLLOW=
own_flag() {
  case $1 in
    --follow) FOLLOW=-F ;;
    --worker=*) WORKER=${1#--worker=} ;;
  esac
}
parse_flags "--dry-run --follow --worker=" "$@"; shift "$NFLAGS"
expect_args 2 "[--dry-run] [--follow] [--worker=N] NAME ZONE" "$@"
case $WORKER in ''|*[!0-9]*) die "--worker=$WORKER: give a worker number (0, 1, ...)" ;; esac
on_workers "$1" "$2" "$WORKER" "tail -n 200 $FOLLOW $REMOTE_LOGS/train.log"

#!/usr/bin/env bash
# Runs on one worker (started there by launch.sh): the trainer with stdin from /dev/null and its
# output in ~/dapo-logs/train.log, copied to WORKDIR/logs/HOSTNAME.log every 5 minutes and at the
# end. Its pid is in ~/dapo-logs/train.pid (stop.sh sends it SIGTERM), its exit status in
# ~/dapo-logs/train.status: 0 finished, 75 preempted (launch again: it resumes), other: failed.
# Usage: worker.sh WORKDIR [trainer flags...]
set -uo pipefail
WORKDIR=$1; shift
LOGS=$HOME/dapo-logs LOG=$HOME/dapo-logs/train.log
mkdir -p "$LOGS" && rm -f "$LOGS/train.status"
copy_log() {
  case $WORKDIR in
    gs://*) gcloud storage cp --quiet "$LOG" "$WORKDIR/logs/$(hostname).log" ;;
    *) mkdir -p "$WORKDIR/logs" && cp "$LOG" "$WORKDIR/logs/$(hostname).log" ;;
  esac
}
cd "$HOME/dapo-jax"
"$HOME/dapo-venv/bin/python" -m dapo_jax.train --workdir="$WORKDIR" "$@" >"$LOG" 2>&1 </dev/null &
PID=$!
echo "$PID" >"$LOGS/train.pid"
trap 'kill -TERM "$PID" 2>/dev/null' TERM  # a SIGTERM to this script reaches the trainer
(trap 'kill $! 2>/dev/null; exit' TERM; while sleep 300 & wait $!; do copy_log; done) \
  </dev/null >/dev/null 2>&1 &
COPIER=$!
RC=0
while kill -0 "$PID" 2>/dev/null; do wait "$PID"; RC=$?; done
kill "$COPIER" 2>/dev/null
copy_log
echo "$RC" >"$LOGS/train.status"
exit "$RC"

#!/usr/bin/env bash
# Runs on one worker (started there by launch.sh, export.sh or evaluate.sh): `python -m
# dapo_jax.JOB` (train, export or evaluate) with stdin from /dev/null and its output in
# ~/dapo-logs/JOB.log, copied to WORKDIR/logs/HOSTNAME.log (train) or HOSTNAME-JOB.log every 5
# minutes and at the end. Its pid is in ~/dapo-logs/JOB.pid (stop.sh sends train's SIGTERM), its
# exit status in ~/dapo-logs/JOB.status: 0 finished, 75 preempted (launch again: it resumes),
# other: failed.
# Usage: worker.sh JOB WORKDIR [flags...]
set -uo pipefail
JOB=$1 WORKDIR=$2; shift 2
case $JOB in train) COPY=$(hostname).log ;; export | evaluate) COPY=$(hostname)-$JOB.log ;;
  *) echo "worker.sh: unknown job $JOB (train, export, evaluate)" >&2; exit 2 ;; esac
LOGS=$HOME/dapo-logs LOG=$HOME/dapo-logs/$JOB.log
mkdir -p "$LOGS" && rm -f "$LOGS/$JOB.status"
copy_log() {
  case $WORKDIR in
    gs://*) gcloud storage cp --quiet "$LOG" "$WORKDIR/logs/$COPY" ;;
    *) mkdir -p "$WORKDIR/logs" && cp "$LOG" "$WORKDIR/logs/$COPY" ;;
  esac
}
cd "$HOME/dapo-jax"
"$HOME/dapo-venv/bin/python" -m "dapo_jax.$JOB" --workdir="$WORKDIR" "$@" >"$LOG" 2>&1 </dev/null &
PID=$!
echo "$PID" >"$LOGS/$JOB.pid"
trap 'kill -TERM "$PID" 2>/dev/null' TERM  # a SIGTERM to this script reaches the trainer
(trap 'kill $! 2>/dev/null; exit' TERM; while sleep 300 & wait $!; do copy_log; done) \
  </dev/null >/dev/null 2>&1 &
COPIER=$!
RC=0
while kill -0 "$PID" 2>/dev/null; do wait "$PID"; RC=$?; done
kill "$COPIER" 2>/dev/null
copy_log
echo "$RC" >"$LOGS/$JOB.status"
exit "$RC"

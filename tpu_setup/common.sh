# Shell helpers sourced by every tpu_setup/ script (not run by itself).
# `parse_flags "FLAG..." "$@"; shift "$NFLAGS"` takes the script's leading flags; `run CMD...`
# runs a command, or prints it (each argument quoted with printf %q, so that a shell reading the
# line gets the same argument list) under --dry-run; `on_workers NAME ZONE WORKERS SCRIPT` runs a
# shell script on workers of a TPU VM / pod slice ("all" or a number) through `gcloud ... ssh
# --command`.

DRY_RUN=0 QUEUED=0
REMOTE_TREE='~/dapo-jax'      # the installed working tree on every worker (~ is the worker's home)
REMOTE_PYTHON='~/dapo-venv/bin/python'
REMOTE_LOGS='~/dapo-logs'     # train.log and train.pid of the worker's current run

die() { echo "$(basename "$0"): $*" >&2; exit 2; }

run() {
  if [ "$DRY_RUN" = 1 ]; then printf '%q ' "$@"; echo; else "$@"; fi
}

on_workers() {  # NAME ZONE WORKERS SCRIPT
  run gcloud compute tpus tpu-vm ssh "$1" --zone="$2" --worker="$3" --command="$4"
}

quote_args() {  # each argument quoted for the workers' shell, joined by spaces
  local out=
  if [ $# -gt 0 ]; then printf -v out '%q ' "$@"; fi
  printf '%s' "${out% }"
}

parse_flags() {  # "FLAG..." "$@": the leading flags among the script's FLAGs (NAME, or NAME= for
  # a flag with a value); --dry-run and --queued set DRY_RUN and QUEUED, the script's own go to its
  # `own_flag FLAG`; any other flag is an error. NFLAGS: how many it took (the caller shifts them).
  local allowed=" $1 " flag; shift
  NFLAGS=0
  while [ $# -gt 0 ]; do
    case $1 in -*) ;; *) break ;; esac
    case $1 in *=*) flag=${1%%=*}= ;; *) flag=$1 ;; esac
    case $allowed in *" $flag "*) ;; *) die "unknown flag $1" ;; esac
    case $1 in
      --dry-run) DRY_RUN=1 ;;
      --queued) QUEUED=1 ;;
      *) own_flag "$1" ;;
    esac
    NFLAGS=$((NFLAGS + 1))
    shift
  done
}

expect_args() {  # N USAGE "$@": exactly N positional arguments, or the usage line
  local n=$1 usage=$2; shift 2
  if [ $# -ne "$n" ]; then echo "usage: $(basename "$0") $usage" >&2; exit 2; fi
}

start_job() {  # NAME ZONE JOB CONFIG WORKDIR [flags...]: `python -m dapo_jax.JOB --multihost` on
  # every worker through worker.sh, detached (nohup, stdin from /dev/null; the redirections are
  # the background command's own, so that ssh returns at once). Each flag reaches the program as
  # one argument, whatever it holds (quotes, spaces, tuples): it is quoted again for the workers.
  local name=$1 zone=$2 job=$3 config=$4 workdir=$5; shift 5
  local args; args=$(quote_args "$job" "$workdir" "--config=$config" --multihost "$@")
  on_workers "$name" "$zone" all "cd $REMOTE_TREE || exit; nohup bash tpu_setup/worker.sh $args \
>/dev/null 2>&1 </dev/null &"
  if [ "$DRY_RUN" = 0 ]; then
    echo "started $job on every worker of $name; tpu_setup/logs.sh --job=$job $name $zone shows worker 0's log"
  fi
}

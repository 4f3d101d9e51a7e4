#!/usr/bin/env bash
# Copy this working tree (tracked and untracked files that git does not ignore: uncommitted edits
# travel too) to every worker of a TPU VM / pod slice, replacing the old copy, and install it with
# jax[tpu] into a Python 3.11 virtualenv made by uv (the TPU images' own python3 is 3.10; the
# package needs >= 3.11).
# Usage: tpu_setup/install.sh [--dry-run] NAME ZONE
# --dry-run prints the gcloud commands instead of running them.
set -euo pipefail
source "$(dirname "$0")/common.sh"
parse_flags "--dry-run" "$@"; shift "$NFLAGS"
expect_args 2 "[--dry-run] NAME ZONE" "$@"
NAME=$1 ZONE=$2
ROOT=$(cd "$(dirname "$0")/.." && pwd)
ARCHIVE=${TMPDIR:-/tmp}/dapo-jax-$$.tar.gz
# Runs on each worker: ~ and "$HOME" are expanded there; quoted so that [tpu] is no glob.
REMOTE="set -e
rm -rf $REMOTE_TREE && mkdir -p $REMOTE_TREE && tar -xzf ~/dapo-jax.tar.gz -C $REMOTE_TREE
rm -f ~/dapo-jax.tar.gz
command -v ~/.local/bin/uv >/dev/null || curl -LsSf https://astral.sh/uv/install.sh | sh
~/.local/bin/uv venv --allow-existing --python 3.11 ~/dapo-venv
~/.local/bin/uv pip install --python $REMOTE_PYTHON -e \"\$HOME/dapo-jax[tpu]\""
if [ "$DRY_RUN" = 0 ]; then
  trap 'rm -f "$ARCHIVE"' EXIT
  git -C "$ROOT" ls-files -z --cached --others --exclude-standard \
    | tar -C "$ROOT" --null -T - --ignore-failed-read -czf "$ARCHIVE"  # deleted files: skipped
fi
run gcloud compute tpus tpu-vm scp "$ARCHIVE" "$NAME:~/dapo-jax.tar.gz" --zone="$ZONE" --worker=all
on_workers "$NAME" "$ZONE" all "$REMOTE"

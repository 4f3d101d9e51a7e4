#!/usr/bin/env bash
# Copy this working tree (tracked and untracked files that git does not ignore) to every worker of
# a TPU VM / pod slice, replacing the old copy, and install it with jax[tpu] into a Python 3.11
# virtualenv made by uv (the TPU images' own python3 is 3.10; the package needs >= 3.11).
# Usage: tpu_setup/install.sh [--dry-run] NAME ZONE
# --dry-run prints the gcloud commands instead of running them.
set -euo pipefail
DRY_RUN=0
if [ "${1:-}" = --dry-run ]; then DRY_RUN=1; shift; fi
if [ $# -ne 2 ]; then echo "usage: $0 [--dry-run] NAME ZONE" >&2; exit 2; fi
NAME=$1 ZONE=$2
ROOT=$(cd "$(dirname "$0")/.." && pwd)
ARCHIVE=${TMPDIR:-/tmp}/dapo-jax-$$.tar.gz
# Runs on each worker: "$HOME" is expanded there, and quoted so that [tpu] is no glob.
REMOTE='set -e
rm -rf ~/dapo-jax && mkdir -p ~/dapo-jax && tar -xzf ~/dapo-jax.tar.gz -C ~/dapo-jax
rm -f ~/dapo-jax.tar.gz
command -v ~/.local/bin/uv >/dev/null || curl -LsSf https://astral.sh/uv/install.sh | sh
~/.local/bin/uv venv --allow-existing --python 3.11 ~/dapo-venv
~/.local/bin/uv pip install --python ~/dapo-venv/bin/python -e "$HOME/dapo-jax[tpu]"'
SCP=(gcloud compute tpus tpu-vm scp "$ARCHIVE" "$NAME:~/dapo-jax.tar.gz" --zone="$ZONE"
     --worker=all)
SSH=(gcloud compute tpus tpu-vm ssh "$NAME" --zone="$ZONE" --worker=all --command="$REMOTE")
if [ "$DRY_RUN" = 1 ]; then
  printf '%q ' "${SCP[@]}"; echo; printf '%q ' "${SSH[@]}"; echo; exit 0
fi
trap 'rm -f "$ARCHIVE"' EXIT
git -C "$ROOT" ls-files -z --cached --others --exclude-standard \
  | tar -C "$ROOT" --null -T - -czf "$ARCHIVE"
"${SCP[@]}"
"${SSH[@]}"

#!/usr/bin/env bash
# Copy this checkout to every worker of a TPU VM / pod slice and install it with jax[tpu].
# Usage: tpu_setup/install.sh NAME ZONE
set -euo pipefail
if [ $# -ne 2 ]; then echo "usage: $0 NAME ZONE" >&2; exit 2; fi
NAME=$1 ZONE=$2
ROOT=$(cd "$(dirname "$0")/.." && pwd)
ARCHIVE=$(mktemp --suffix=.tar.gz)
git -C "$ROOT" archive --format=tar.gz -o "$ARCHIVE" HEAD
gcloud compute tpus tpu-vm scp "$ARCHIVE" "$NAME":~/dapo-jax.tar.gz --zone="$ZONE" --worker=all
gcloud compute tpus tpu-vm ssh "$NAME" --zone="$ZONE" --worker=all --command='
  set -e; mkdir -p ~/dapo-jax && tar -xzf ~/dapo-jax.tar.gz -C ~/dapo-jax
  python3 -m venv ~/dapo-venv && ~/dapo-venv/bin/pip install -q -e "~/dapo-jax[tpu]"'
rm -f "$ARCHIVE"

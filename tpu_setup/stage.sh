#!/usr/bin/env bash
# Copy a model or data folder to the local disk of every worker, once: from gs:// (gcloud storage
# rsync) or from the Hugging Face Hub (an ORG/NAME id, downloaded by the venv's `hf` CLI). A worker
# that already holds DEST/.dapo-staged skips the copy. Nothing at training time downloads.
# Usage: tpu_setup/stage.sh [--dry-run] NAME ZONE SOURCE DEST
#   e.g. tpu_setup/stage.sh dapo-v5p us-east5-a gs://bucket/Qwen2.5-32B models/qwen2_5_32b
#        tpu_setup/stage.sh dapo-v5p us-east5-a Qwen/Qwen2.5-32B models/qwen2_5_32b
#        tpu_setup/stage.sh dapo-v5p us-east5-a gs://bucket/dapo-data data
# DEST is on the workers, relative to their home folder unless absolute (then point
# config.model.path / config.data.* at it, relative to ~/dapo-jax or absolute).
set -euo pipefail
source "$(dirname "$0")/common.sh"
parse_flags "--dry-run" "$@"; shift "$NFLAGS"
expect_args 4 "[--dry-run] NAME ZONE SOURCE DEST" "$@"
NAME=$1 ZONE=$2 SOURCE=$3 DEST=$4
case $SOURCE in
  gs://*) FETCH="gcloud storage rsync --recursive $(quote_args "$SOURCE" "$DEST")" ;;
  *://*) die "source $SOURCE: give a gs:// folder or a Hub id ORG/NAME" ;;
  */*) FETCH="~/dapo-venv/bin/hf download $(quote_args "$SOURCE") --local-dir $(quote_args "$DEST")" ;;
  *) die "source $SOURCE: give a gs:// folder or a Hub id ORG/NAME" ;;
esac
MARK=$(quote_args "$DEST/.dapo-staged")
on_workers "$NAME" "$ZONE" all "set -e
if [ -e $MARK ]; then echo \"\$(hostname): $(quote_args "$DEST") already staged\"; exit 0; fi
mkdir -p $(quote_args "$DEST")
$FETCH
touch $MARK"

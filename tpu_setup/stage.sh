#!/usr/bin/env bash
# Copy a model or data folder from gs:// (gcloud storage rsync, in the slice's region: no egress)
# to the local disk of every worker, once: a worker that already holds DEST/.dapo-staged skips the
# copy. Nothing at training time downloads. A model of the Hugging Face Hub goes to the bucket
# first, once for the whole slice (tpu_setup/hub_to_gcs.sh), not from the Hub to every worker.
# Usage: tpu_setup/stage.sh [--dry-run] NAME ZONE SOURCE DEST
#   e.g. tpu_setup/stage.sh dapo-v5p us-east5-a gs://bucket/Qwen2.5-32B models/qwen2_5_32b
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
  *://*) die "source $SOURCE: give a gs:// folder" ;;
  */*) die "source $SOURCE: put a Hub model on your bucket once first (tpu_setup/hub_to_gcs.sh NAME ZONE $SOURCE gs://BUCKET/...), then stage that gs:// folder" ;;
  *) die "source $SOURCE: give a gs:// folder" ;;
esac
MARK=$(quote_args "$DEST/.dapo-staged")
on_workers "$NAME" "$ZONE" all "set -e
if [ -e $MARK ]; then echo \"\$(hostname): $(quote_args "$DEST") already staged\"; exit 0; fi
mkdir -p $(quote_args "$DEST")
$FETCH
touch $MARK"

#!/usr/bin/env bash
# Put a model of the Hugging Face Hub on a bucket, once for the whole slice: worker 0 downloads it
# (the venv's `hf` CLI) into a scratch folder, copies it to gs://... (gcloud storage rsync) and
# removes the scratch copy; stage.sh then copies the bucket's folder to every worker. A bucket that
# already holds DEST/config.json is left as it is.
# Usage: tpu_setup/hub_to_gcs.sh [--dry-run] NAME ZONE ORG/MODEL gs://BUCKET/FOLDER
#   e.g. tpu_setup/hub_to_gcs.sh dapo-v5p us-east5-a Qwen/Qwen2.5-32B gs://my-bucket/Qwen2.5-32B
set -euo pipefail
source "$(dirname "$0")/common.sh"
parse_flags "--dry-run" "$@"; shift "$NFLAGS"
expect_args 4 "[--dry-run] NAME ZONE ORG/MODEL gs://BUCKET/FOLDER" "$@"
NAME=$1 ZONE=$2 MODEL=$3 DEST=$4
case $MODEL in *://* | */*/* | /* | */) die "model $MODEL: give a Hub id ORG/MODEL" ;; ?*/?*) ;;
  *) die "model $MODEL: give a Hub id ORG/MODEL" ;; esac
case $DEST in gs://*/*) ;; *) die "destination $DEST: give a gs://BUCKET/FOLDER" ;; esac
SCRATCH='~/dapo-hub-download'
on_workers "$NAME" "$ZONE" 0 "set -e
if gcloud storage ls $(quote_args "$DEST/config.json") >/dev/null 2>&1; then
  echo $(quote_args "$DEST") already holds a model; exit 0; fi
rm -rf $SCRATCH
~/dapo-venv/bin/hf download $(quote_args "$MODEL") --local-dir $SCRATCH
gcloud storage rsync --recursive --exclude='^\\.cache/' $SCRATCH $(quote_args "$DEST")
rm -rf $SCRATCH"

#!/usr/bin/env bash
# Create a TPU VM or pod slice.  Usage: tpu_setup/create.sh NAME ZONE TYPE [RUNTIME]
#   e.g. tpu_setup/create.sh dapo-v5p us-east5-a v5p-64 v2-alpha-tpuv5
# Add --spot or --preemptible through EXTRA_ARGS; a preempted run resumes from its last checkpoint.
set -euo pipefail
if [ $# -lt 3 ]; then echo "usage: $0 NAME ZONE ACCELERATOR_TYPE [RUNTIME_VERSION]" >&2; exit 2; fi
NAME=$1 ZONE=$2 TYPE=$3 RUNTIME=${4:-tpu-ubuntu2204-base}
gcloud compute tpus tpu-vm create "$NAME" --zone="$ZONE" --accelerator-type="$TYPE" \
  --version="$RUNTIME" ${EXTRA_ARGS:-}

#!/usr/bin/env bash
# The peers' virtualenvs for experiments/bench_peers.py, outside the repository (default /work/peers):
#   bash experiments/setup_peers.sh [DIR]
# TRL 1.16 on torch 2.13.0 CPU, torch first so that trl does not pull a CUDA build (on a machine
# without a local CPU wheel, give pip PyTorch's CPU index for that line), and Tunix 0.1.7, whose
# safetensors loader needs safetensors < 0.8. The versions are the ones the benchmark was run
# with. Nothing in the test suite or CI needs these.
set -euo pipefail
dir=${1:-/work/peers}
mkdir -p "$dir"
python3 -m venv "$dir/trl"
"$dir/trl/bin/pip" install -q "torch==2.13.0"
"$dir/trl/bin/pip" install -q "trl==1.16.0" "transformers==5.24.0" "accelerate==1.15.0" "datasets==5.2.0"
python3 -m venv "$dir/tunix"
"$dir/tunix/bin/pip" install -q "google-tunix==0.1.7" "safetensors<0.8" "jax==0.10.2" "flax==0.12.8" \
  "transformers==5.12.1"
"$dir/trl/bin/python" -c "import torch, trl; print('trl', trl.__version__, 'torch', torch.__version__)"
"$dir/tunix/bin/python" -c "import importlib.metadata as m; print('tunix', m.version('google-tunix'))"

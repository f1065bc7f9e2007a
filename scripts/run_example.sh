#!/usr/bin/env bash
# The main job, from a fresh machine: set up .venv, then train a small transformer LM with zero3_offload on 2 CPU
# processes (2 GPUs when CUDA is present; --devices N for another count, 0 for all), evaluate with exact distributed
# metrics, export to safetensors and reload. Extra arguments go to examples/train_lm.py (see --help).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. scripts/env.sh
.venv/bin/python examples/train_lm.py "$@"

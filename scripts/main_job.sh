#!/usr/bin/env bash
# The main job: installs everything on a fresh machine (the pinned Python packages into
# .cache/venv, sdp4bit itself with `pip install .`, which builds the Rust core with cargo), then
# trains a small byte-level GPT on CPU with 4 gloo ranks as 2 emulated nodes x 2 ranks, using
# megatron-core's DDP and the sdp4bit preset, and prints the loss and the bytes saved.
# Extra arguments go to examples/gpt_cpu/train.py (e.g. --steps 200, --preset qsdp).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/python_env.sh
echo "== pip install . (cargo builds the Rust core, then the torch extension)"
"${PIP[@]}" install --no-deps .
echo "== training: torchrun, 4 ranks on CPU (2 nodes x 2 ranks), sdp4bit preset"
export OMP_NUM_THREADS=1 PYTHONWARNINGS=ignore
"$VENV/bin/torchrun" --standalone --nproc-per-node 4 examples/gpt_cpu/train.py \
  --ranks-per-node 2 "$@"

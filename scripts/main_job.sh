#!/usr/bin/env bash
# The main job. On a fresh machine it sets everything up (the pinned Python packages into the
# virtual environment .cache/venv, see scripts/env.sh; sdp4bit itself with `pip install .`,
# which builds the Rust core with cargo and the extension against the installed torch, skipped
# when the installed package was built from the tree as it is now), then trains
# megatron-core's GPTModel (a small byte-level GPT) on CPU with 4 gloo ranks as 2 emulated
# nodes x 2 ranks, using megatron-core's DDP and real DistributedOptimizer and the sdp4bit
# preset, and prints the loss and the bytes saved.
# Extra arguments go to examples/gpt_cpu/train.py (e.g. --steps 200, --preset qsdp).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
echo "== the Python environment (.cache/venv) and sdp4bit in it"
sdp4bit_main_venv
sdp4bit_install_current
echo "== training: torchrun, 4 ranks on CPU (2 nodes x 2 ranks), sdp4bit preset"
export OMP_NUM_THREADS=1 PYTHONWARNINGS=ignore
cd /tmp  # the installed package, not the repository's source tree, is the one to import
exec torchrun --standalone --nproc-per-node 4 "$SDP4BIT_ROOT/examples/gpt_cpu/train.py" \
  --ranks-per-node 2 "$@"

#!/usr/bin/env bash
# The project's test command: formatting, lints, every Rust test, and a smoke run of the CPU
# benchmark. Needs a Rust toolchain and Python's pip: cargo fetches the pinned crates
# (Cargo.lock), pip fetches NVRTC (the CUDA runtime compiler, no GPU needed) into .cache/ so the
# CUDA kernels are compile-checked on every run.
set -euo pipefail
cd "$(dirname "$0")/.."

NVRTC_VERSION=13.0.88
NVRTC_PREFIX=.cache/nvrtc-$NVRTC_VERSION
if [ ! -f "$NVRTC_PREFIX/nvidia/cu13/lib/libnvrtc.so.13" ]; then
  echo "== installing NVRTC $NVRTC_VERSION into $NVRTC_PREFIX"
  python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore --no-deps \
    --target "$NVRTC_PREFIX" "nvidia-cuda-nvrtc==$NVRTC_VERSION"
fi
export LD_LIBRARY_PATH="$PWD/$NVRTC_PREFIX/nvidia/cu13/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# The kernel compile test must fail, not skip, when NVRTC cannot be loaded.
export SDP4BIT_REQUIRE_NVRTC=1
# The emulated-GPU kernel test runs its full sweep (about 25 s on 2 cores).
export SDP4BIT_EMULATOR_FULL=1

echo "== cargo fmt --check"
cargo fmt --all -- --check
echo "== cargo clippy -D warnings"
cargo clippy --locked --release --all-targets -- -D warnings
echo "== cargo test"
cargo test --locked --release
echo "== GPU tests again, uncaptured, to show whether they ran or why they skipped"
cargo test --locked --release --test cuda_gpu -- --nocapture --test-threads=1 2>&1 \
  | sed -nE 's/.*(skipped: [^[(]*).*/\1/p; /^test result/p' | sort | uniq -c
echo "== benchmark smoke run (SDP4BIT_BENCH_QUICK=1)"
SDP4BIT_BENCH_QUICK=1 cargo bench --locked --bench cpu
echo "== GPU benchmark smoke run (skips without a GPU)"
SDP4BIT_BENCH_QUICK=1 cargo bench --locked --bench gpu

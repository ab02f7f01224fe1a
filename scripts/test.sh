#!/usr/bin/env bash
# The project's test command: formatting, lints, every Rust test, the torch extension built
# three ways (pip install ., from an sdist, from a prebuilt native bundle) and its multi-process
# tests, and smoke runs of the benchmarks. Needs a Rust toolchain, Python 3.11 and pip: cargo
# fetches the pinned crates (Cargo.lock); pip fetches NVRTC (the CUDA runtime compiler, no GPU
# needed) into .cache/ so the CUDA kernels are compile-checked, and the pinned Python packages
# (requirements-test.txt) into the virtual environment .cache/venv.
set -euo pipefail
cd "$(dirname "$0")/.."

NVRTC_VERSION=13.0.88
# The newest megatron-core the integration tests also run against (see the pytest step).
MCORE_NEXT=0.19.2
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
echo "== cargo clippy -D warnings (with and without the ffi feature)"
cargo clippy --locked --release --all-targets -- -D warnings
cargo clippy --locked --release --all-targets --features ffi -- -D warnings
echo "== cargo test"
cargo test --locked --release
echo "== GPU tests again, uncaptured, to show whether they ran or why they skipped"
cargo test --locked --release --test cuda_gpu -- --nocapture --test-threads=1 2>&1 \
  | sed -nE 's/.*(skipped: [^[(]*).*/\1/p; /^test result/p' | sort | uniq -c
echo "== benchmark smoke run (SDP4BIT_BENCH_QUICK=1)"
SDP4BIT_BENCH_QUICK=1 cargo bench --locked --bench cpu
echo "== GPU benchmark smoke run (skips without a GPU)"
SDP4BIT_BENCH_QUICK=1 cargo bench --locked --bench gpu

source scripts/python_env.sh
smoke() {
  (cd /tmp && "$ROOT/$VENV/bin/python" -W ignore -c "
import torch, megatron_patch as m
c = m.Sdp4bitConfig('sdp4bit')
x = torch.randn(4, 4096)
y = torch.ops.sdp4bit.simulate_grad_reduce_scatter(c.spec(), [0, 0, 1, 1], 0, 0, x)
print('   extension loads from', m.__file__, '| fingerprint', hex(c.fingerprint()),
      '| max err', float((y.reshape(-1) - x.sum(0)).abs().max()))")
}
ROOT=$PWD
echo "== pip install from an sdist"
rm -rf .cache/dist && "$VENV/bin/python" -m build --sdist --no-isolation --outdir .cache/dist . >/dev/null
# The sdist builds in a temporary directory; sharing the target directory reuses compiled crates.
CARGO_TARGET_DIR=$PWD/target "${PIP[@]}" install --no-deps --force-reinstall .cache/dist/sdp4bit-*.tar.gz
smoke
echo "== pip install with a prebuilt native bundle and no cargo"
"$VENV/bin/python" scripts/build_native.py --out .cache/native-bundle >/dev/null
SDP4BIT_NATIVE_DIR=$PWD/.cache/native-bundle CARGO=/nonexistent/cargo \
  "${PIP[@]}" install --no-deps --force-reinstall .
smoke
echo "== pip install ."
"${PIP[@]}" install --no-deps --force-reinstall .
smoke
echo "== pytest tests/python (multi-process gloo)"
"$VENV/bin/pytest" -q -rs tests/python
echo "== pytest tests/python/test_megatron.py against megatron-core $MCORE_NEXT (pure Python, under 3.11)"
# megatron-core 0.17+ declares Python 3.12; its megatron.core is pure Python, so its wheel is
# unpacked beside the pinned 0.16.1 and put first on the path for the integration tests.
NEXT_DIR=".cache/megatron-core-$MCORE_NEXT"
if [ ! -d "$NEXT_DIR/megatron/core" ]; then
  rm -rf "$NEXT_DIR" .cache/mcore-wheel
  "${PIP[@]}" download --no-deps --only-binary=:all: --python-version 3.12 \
    --dest .cache/mcore-wheel "megatron-core==$MCORE_NEXT"
  "$VENV/bin/python" -m zipfile -e .cache/mcore-wheel/megatron_core-"$MCORE_NEXT"-*.whl "$NEXT_DIR"
fi
PYTHONPATH="$ROOT/$NEXT_DIR" "$VENV/bin/pytest" -q tests/python/test_megatron.py
echo "== convergence study smoke run (3 steps, 3 rows; the study itself is bench/convergence.py)"
(cd /tmp && OMP_NUM_THREADS=1 "$ROOT/$VENV/bin/python" "$ROOT/bench/convergence.py" --steps 3 \
  --rows baseline,qWD,SDP4Bit --out "$ROOT/.cache/convergence-smoke")
test -s .cache/convergence-smoke/convergence.png

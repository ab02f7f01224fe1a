#!/usr/bin/env bash
# The project's test command. On a fresh machine with the README's prerequisites (Rust,
# Python 3.11 with pip and venv, g++) it sets everything up itself: cargo fetches the pinned
# crates (Cargo.lock); pip fetches NVRTC (the CUDA runtime compiler, no GPU needed) into .cache/
# so the CUDA kernels are compile-checked, and the pinned Python packages into the virtual
# environments under .cache/ (scripts/env.sh), which it makes while the Rust steps run.
#
# Steps: rustfmt; clippy; every Rust test; the benchmarks' smoke runs; the torch extension
# built once per torch version (the pinned one from an sdist with cargo offline, from its
# vendored crates; the floor and then the newest from this one checkout with a prebuilt native
# bundle and no cargo); the multi-process tests (pytest) against megatron-core 0.16.1 and
# 0.19.2; the convergence study's smoke run; the portable wheel, installed without cargo into a
# fresh environment and compiled at first import. Each step prints its elapsed time; a summary
# closes the log. Any failure stops it with an error.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
ROOT=$SDP4BIT_ROOT
# Every build of the extension here registers the tests' in-process references
# (torch.ops.sdp4bit.simulate_*, cargo feature test-ops; scripts/build_native.py).
export SDP4BIT_TEST_OPS=1

# The newest megatron-core the integration tests also run against (see the pytest steps).
MCORE_NEXT=0.19.2
# The torch versions besides the pinned one (requirements-test.txt) that the extension is built
# against and checked with: the supported floor and the newest on PyPI.
COMPAT_TORCH=(floor newest)

STEP= STEP_START=$SECONDS
TIMES=()
step() {
  local now=$SECONDS
  if [ -n "$STEP" ]; then
    echo "   [$STEP: $((now - STEP_START)) s]"
    TIMES+=("$(printf '%5d s  %s' $((now - STEP_START)) "$STEP")")
  fi
  STEP=$1 STEP_START=$now
  if [ -n "$STEP" ]; then echo "== $STEP"; fi
}
summary() {
  echo "== disk: $(df -h --output=avail . | tail -1 | tr -d ' ') free; this checkout $(du -sh . | cut -f1)"
  echo "== elapsed time per step"
  printf '%s\n' "${TIMES[@]}"
  printf '%5d s  total\n' "$SECONDS"
}
trap 'status=$?; if [ $status -ne 0 ]; then echo "FAILED (exit $status) in step: $STEP"; step ""; summary; fi' EXIT

step "NVRTC $SDP4BIT_NVRTC_VERSION into .cache/"
sdp4bit_nvrtc
# The kernel compile test must fail, not skip, when NVRTC cannot be loaded.
export SDP4BIT_REQUIRE_NVRTC=1

step "ptxas $SDP4BIT_PTXAS_VERSION and nvdisasm into .cache/"
sdp4bit_cuda_tools
# The kernel resource checks (registers, spills, access widths) must fail, not skip, without
# them.
export SDP4BIT_REQUIRE_PTXAS=1
# The emulated-GPU kernel test runs its full sweep.
export SDP4BIT_EMULATOR_FULL=1

step "Python environments, made in the background while the Rust steps run"
mkdir -p .cache/logs
sdp4bit_venv "$SDP4BIT_MAIN_VENV" requirements-test.txt requirements-deepspeed.txt \
  > .cache/logs/venv-main.log 2>&1 &
MAIN_ENV_PID=$!
# The newest torch's environment runs Python 3.12 where the machine has one (pyenv's too), so
# the extension, the collectives and the portable wheel are also checked under 3.12.
NEWEST_PYTHON=$(sdp4bit_python312) || {
  NEWEST_PYTHON=python3
  echo "   NOTE: no Python 3.12 on this machine (PATH, ~/.pyenv): the newest torch and the wheel" \
    "are checked under $(python3 --version) only"
}
(
  set -e
  for name in "${COMPAT_TORCH[@]}"; do
    python=python3
    if [ "$name" = newest ]; then python=$NEWEST_PYTHON; fi
    SDP4BIT_VENV_PYTHON=$python sdp4bit_venv ".cache/venv-torch-$name" "requirements-torch-$name.txt"
  done
) > .cache/logs/venv-compat.log 2>&1 &
COMPAT_ENVS_PID=$!
# wait_for PID LOG: the background job's log, and a failure if it failed.
wait_for() {
  local status=0
  wait "$1" || status=$?
  cat "$2"
  if [ "$status" -ne 0 ]; then
    echo "making a Python environment failed (log above)" >&2
    exit 1
  fi
}

step "cargo fmt --check"
cargo fmt --all -- --check
step "cargo clippy -D warnings (all targets; with test-ops every line of Rust, then as a wheel builds it)"
cargo clippy --locked --release --all-targets --features test-ops -- -D warnings
cargo clippy --locked --release --lib --features ffi -- -D warnings
step "cargo test"
cargo test --locked --release
step "GPU tests again, uncaptured, to show whether they ran or why they skipped"
cargo test --locked --release --test cuda_gpu -- --nocapture --test-threads=1 2>&1 \
  | sed -nE 's/.*(skipped: [^[(]*).*/\1/p; /^test result/p' | sort | uniq -c
step "benchmark smoke runs (SDP4BIT_BENCH_QUICK=1; the GPU one skips without a GPU)"
SDP4BIT_BENCH_QUICK=1 bash scripts/bench.sh cpu
SDP4BIT_BENCH_QUICK=1 bash scripts/bench.sh gpu
bash scripts/bench.sh kernels > /dev/null

step "waiting for the main Python environment"
wait_for "$MAIN_ENV_PID" .cache/logs/venv-main.log
sdp4bit_use "$SDP4BIT_MAIN_VENV"

# Imports the installed package in a fresh interpreter outside the repository and runs one
# in-process collective through the extension.
smoke() {
  (cd /tmp && "$1/bin/python" -W ignore -c "
import sys, torch, sdp4bit as m
c = m.Config('sdp4bit')
x = torch.randn(4, 4096)
y = torch.ops.sdp4bit.simulate_grad_reduce_scatter(c.spec(), [0, 0, 1, 1], 0, 0, x)
print('   Python', sys.version.split()[0], '| torch', torch.__version__, '| extension from',
      m.__file__,
      '| max err', float((y.reshape(-1) - x.sum(0)).abs().max()))")
}

step "pip install from an sdist offline: no index, cargo builds the Rust core from its vendored crates with the network off and an empty CARGO_HOME (torch pinned)"
rm -rf .cache/dist && python -m build --sdist --no-isolation --outdir .cache/dist . >/dev/null
# The listing goes to a file: `tar | grep -q` fails under pipefail when grep's early exit
# stops tar with SIGPIPE.
tar tzf .cache/dist/sdp4bit-*.tar.gz > .cache/dist/contents.txt
grep -q '^sdp4bit-[^/]*/vendor/cxx-1\.' .cache/dist/contents.txt
# The sdist builds in a temporary directory; cargo compiles the vendored crates again (they are
# another source to it) into the shared target directory.
OFFLINE_CARGO_HOME=$(mktemp -d)
CARGO_NET_OFFLINE=true CARGO_HOME=$OFFLINE_CARGO_HOME CARGO_TARGET_DIR=$ROOT/target \
  pip install --quiet --no-index --no-build-isolation --no-deps --force-reinstall \
  .cache/dist/sdp4bit-*.tar.gz
rm -rf "$OFFLINE_CARGO_HOME"
sdp4bit_record_install "$SDP4BIT_MAIN_VENV"
smoke "$SDP4BIT_MAIN_VENV"

step "GPU kit: bash scripts/gpu_kit.sh prepare (checked, and dry-run, by tests/python/test_gpu_kit.py)"
bash scripts/gpu_kit.sh prepare
export SDP4BIT_REQUIRE_GPU_KIT=1

step "pytest tests/python (multi-process gloo; megatron-core 0.16.1)"
pytest -q -rs --durations=15 tests/python

step "pytest tests/python/test_megatron*.py against megatron-core $MCORE_NEXT (pure Python, under 3.11)"
# megatron-core 0.17+ declares Python 3.12; its megatron.core is pure Python, so its wheel is
# unpacked beside the pinned 0.16.1 and put first on the path for the integration tests.
NEXT_DIR=".cache/megatron-core-$MCORE_NEXT"
if [ ! -d "$NEXT_DIR/megatron/core" ]; then
  rm -rf "$NEXT_DIR" .cache/mcore-wheel
  pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
    --dest .cache/mcore-wheel "megatron-core==$MCORE_NEXT"
  python -m zipfile -e .cache/mcore-wheel/megatron_core-"$MCORE_NEXT"-*.whl "$NEXT_DIR"
fi
PYTHONPATH="$ROOT/$NEXT_DIR" pytest -q tests/python/test_megatron*.py

step "convergence study smoke run (3 steps, 2 rows x 2 seeds; the study is bench/convergence.py)"
OMP_NUM_THREADS=1 bash scripts/bench.sh convergence --steps 3 --seeds 1,2 --rows baseline,SDP4Bit \
  --val-tokens 4096 --out .cache/convergence-smoke
test -s .cache/convergence-smoke/convergence.png
grep -q "SDP4Bit's interval is" .cache/convergence-smoke/convergence.md

step "long convergence study smoke run (3 steps, SDP4Bit, its baseline and the controls x 2 seeds; the study is bench/convergence_long.py)"
OMP_NUM_THREADS=1 bash scripts/bench.sh convergence_long --steps 3 --seeds 1,2 \
  --rows "baseline,SDP4Bit,positive: qW8/shard,null control,positive: qW8/4096" --val-tokens 4096 \
  --out .cache/convergence-long-smoke
test -s .cache/convergence-long-smoke/convergence_long.png
grep -q "Null control" .cache/convergence-long-smoke/convergence_long.md

step "the kept convergence studies reproduce: seed 1's first 15 steps rerun bit for bit where this machine computes as the study's did"
bash scripts/bench.sh convergence_reproduce --steps 15
bash scripts/bench.sh convergence_reproduce --kept bench/results/long/convergence_long.json \
  --pairs baseline,SDP4Bit --steps 15

step "the Hadamard transform on real gradients, smoke run (3 steps; the analysis is bench/hadamard_real.py)"
bash scripts/bench.sh hadamard_real --out .cache/hadamard-smoke --steps 3 --dump-steps 0,2 --draws 2 \
  --seeds 1,2
grep -q "| 2 | outlier channels | [0-9.]*, [0-9.]* | [0-9.]* ± " .cache/hadamard-smoke/hadamard_real.md

step "native bundle from the tree (python scripts/build_native.py), and one as a wheel builds it"
python scripts/build_native.py --out .cache/native-bundle >/dev/null
# Without SDP4BIT_TEST_OPS the tests' in-process references are not in the library at all.
SDP4BIT_TEST_OPS= python scripts/build_native.py --out .cache/native-bundle-wheel >/dev/null
# readelf reads every member (binutils' nm skips objects with as many sections as Rust's);
# the counts are taken whole (no grep -q, whose early exit would stop readelf mid-pipe).
simulate_symbols() { readelf -W --syms "$1/lib/libsdp4bit.a" | grep -c simulate_ || true; }
if [ "$(simulate_symbols .cache/native-bundle)" -eq 0 ]; then
  echo "no simulate_* symbol found in the test build's bundle: the check below sees nothing"; exit 1
fi
if grep -q simulate_ .cache/native-bundle-wheel/include/sdp4bit/src/ffi/mod.rs.h \
  || [ "$(simulate_symbols .cache/native-bundle-wheel)" -ne 0 ]; then
  echo "a bundle built without SDP4BIT_TEST_OPS holds the tests' simulate_* functions"; exit 1
fi
grep -qx ffi .cache/native-bundle-wheel/features.txt
step "waiting for the other torch versions' environments"
wait_for "$COMPAT_ENVS_PID" .cache/logs/venv-compat.log
for name in "${COMPAT_TORCH[@]}"; do
  venv=$ROOT/.cache/venv-torch-$name
  version=$("$venv/bin/python" -c 'import platform, torch
print(torch.__version__, "under Python", platform.python_version())')
  step "torch $version ($name): pip install . from this checkout (after the other torch's: rebuilt, not reused) with the prebuilt bundle and no cargo, one collective, FSDP2"
  (
    sdp4bit_use "$venv"
    SDP4BIT_NATIVE_DIR=$ROOT/.cache/native-bundle CARGO=/nonexistent/cargo \
      pip install --quiet --no-deps --no-build-isolation --force-reinstall .
    smoke "$venv"
    pytest -q -p no:cacheprovider tests/python/test_native.py \
      "tests/python/test_collectives.py::test_every_preset_equals_the_in_process_collective[W4-2x2]" \
      tests/python/test_fsdp.py::test_w4_collectives_equal_the_core_with_the_topology_given
  )
done

step "portable wheel (python scripts/build_wheel.py): fresh environments without cargo install it and compile the glue at first import; 4 ranks and the main job under the newest torch (Python 3.12) and the floor"
SDP4BIT_NATIVE_DIR=$ROOT/.cache/native-bundle-wheel python scripts/build_wheel.py --out .cache/wheel \
  >/dev/null
# The extensions compiled at first import are cached per bundle, torch ABI and Python.
SDP4BIT_WHEEL=$(echo "$ROOT"/.cache/wheel/sdp4bit-*.whl) SDP4BIT_REQUIRE_WHEEL=1 \
  SDP4BIT_WHEEL_ENVS=$ROOT/.cache/venv-torch-newest:$ROOT/.cache/venv-torch-floor \
  SDP4BIT_EXTENSIONS_DIR=$ROOT/.cache/sdp4bit-extensions \
  pytest -q -p no:cacheprovider tests/python/test_wheel.py

step ""
summary
echo "test command: all steps passed"

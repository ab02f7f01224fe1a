#!/usr/bin/env bash
# The GPU kit (docs/gpu-kit.md): everything a borrowed single-GPU host needs to check sdp4bit's
# CUDA path, prepared here, and the one command that runs it there.
#
#   bash scripts/gpu_kit.sh prepare [--out DIR]    on a machine with Rust and the project's
#                                                  environment: builds the kit into DIR
#                                                  (default .cache/gpu-kit) and prints its size
#   bash scripts/gpu_kit.sh run --out DIR [--kit DIR] [--deadline SECONDS]
#                                                  on the GPU host (python3 with torch): runs
#                                                  every stage (the checks, the sweep of the
#                                                  kernel variants, the benchmark, ncu, the
#                                                  training), writes DIR/report.md and
#                                                  DIR/logs.tar.gz; exit 0 all passed, 1 a stage
#                                                  failed, 2 no GPU (every GPU stage skipped)
#
# The kit holds what the host cannot build (it has no Rust toolchain and no network): the
# native bundle (the Rust core as a static library, for building the extension against the
# host's own torch and Python), the package with its extension prebuilt here, the release
# binaries of the GPU tests and the GPU benchmark, and megatron-core as a wheel. The runner
# itself is scripts/gpu_kit.py, which travels with the tree.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

# What travels to the host is the tree plus the kit, 64 MiB in all; the kit keeps this much
# below it, leaving the rest to the tree.
KIT_MAX_MIB=56
# megatron-core for the training stage, as the test environment pins it.
MCORE_VERSION=$(sed -nE 's/^megatron-core==([0-9.]+).*/\1/p' requirements-test.txt)

usage() {
  echo "usage: bash scripts/gpu_kit.sh prepare [--out DIR] | run --out DIR [--kit DIR] [--deadline SECONDS]" >&2
  exit 2
}

# The path of the one executable cargo built for `--test NAME` / `--bench NAME` (JSON messages
# on stdin).
executable_of() {
  python3 -c '
import json, sys
name = sys.argv[1]
paths = [m["executable"] for m in map(json.loads, sys.stdin)
         if m.get("reason") == "compiler-artifact" and m.get("executable")
         and m["target"]["name"] == name]
if len(paths) != 1:
    sys.exit(f"cargo built {len(paths)} executables named {name}")
print(paths[0])' "$1"
}

prepare() {
  local out=$ROOT/.cache/gpu-kit
  while [ $# -gt 0 ]; do
    case "$1" in
      --out) out=$(realpath -m "$2"); shift 2 ;;
      *) usage ;;
    esac
  done
  source scripts/env.sh
  sdp4bit_main_venv
  rm -rf "$out"
  mkdir -p "$out/bin" "$out/wheels"

  echo "== release binaries: the GPU tests and the GPU benchmark"
  local name path
  for name in cuda_gpu cuda_gpu_collectives; do
    path=$(cargo test --locked --release --no-run --test "$name" --message-format=json \
      2>/dev/null | executable_of "$name")
    strip -o "$out/bin/$name" "$path"
  done
  path=$(cargo bench --locked --no-run --bench gpu --message-format=json 2>/dev/null \
    | executable_of gpu)
  strip -o "$out/bin/bench_gpu" "$path"

  echo "== native bundle (the host builds the extension from it)"
  # With the tests' in-process references (the kit's collectives check compares with them).
  SDP4BIT_TEST_OPS=1 python scripts/build_native.py --out "$out/native" >/dev/null
  strip --strip-debug "$out/native/lib/libsdp4bit.a"

  echo "== the package with its extension built here (torch $(python -c 'import torch; print(torch.__version__)'), Python $(python -c 'import platform; print(platform.python_version())'))"
  rm -rf build
  SDP4BIT_NATIVE_DIR=$out/native pip install --quiet --no-deps --no-build-isolation \
    --no-compile --target "$out/site" .
  rm -rf build "$out"/site/*.dist-info
  strip --strip-debug "$out"/site/sdp4bit/_sdp4bit*.so

  echo "== megatron-core $MCORE_VERSION as a wheel for Python 3.12"
  pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
    --dest "$out/wheels" "megatron-core==$MCORE_VERSION"

  python scripts/gpu_kit.py manifest --kit "$out" --max-mib "$KIT_MAX_MIB"
}

case "${1:-}" in
  prepare) shift; prepare "$@" ;;
  # The host's own python3 (the one holding torch), never the project's environment.
  run) shift; exec python3 scripts/gpu_kit.py run "$@" ;;
  *) usage ;;
esac

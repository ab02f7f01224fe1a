# Sourced by every script of the project that runs Python (the test command, the main job,
# the benchmark harnesses): the project's virtual environments live under .cache/, are made on
# first use from pinned requirement files, and the one in use goes first on PATH, so python,
# pip, pytest, torchrun and ninja all come from it and nothing else on the machine is needed
# beyond the README's prerequisites (Rust, Python 3.11 with pip and venv, g++).
#
#   sdp4bit_venv DIR REQS [REQS_NB]    makes the virtual environment DIR (if missing) and
#                                      installs the pinned requirement file REQS into it, then
#                                      REQS_NB without build isolation (DeepSpeed's setup.py
#                                      imports torch); skipped when DIR already holds exactly
#                                      these files' contents; with the interpreter
#                                      SDP4BIT_VENV_PYTHON (default python3; DIR is made again
#                                      when its Python differs)
#   sdp4bit_python312                  prints a Python 3.12 interpreter's path, or fails
#   sdp4bit_use DIR                    puts DIR/bin first on PATH and sets VIRTUAL_ENV
#   sdp4bit_main_venv                  the environment of the full test suite, the main job
#                                      and the benchmark harnesses (.cache/venv:
#                                      requirements-test.txt, DeepSpeed), made and put first
#                                      on PATH
#   sdp4bit_torch_view DIR FROM        a new virtual environment DIR that sees the packages of
#                                      the environment FROM (torch and the rest, not sdp4bit)
#                                      through links: a fresh place to install sdp4bit into
#                                      without copying gigabytes of torch; pip there only ever
#                                      adds sdp4bit (install with --no-deps or --no-index)
#   sdp4bit_install_current            pip install . into the environment in use unless the
#                                      installed package was built from the tree as it is
#   sdp4bit_nvrtc                      NVRTC (the CUDA runtime compiler, no GPU needed) in
#                                      .cache/, put on LD_LIBRARY_PATH for the CUDA backend
#   sdp4bit_cuda_tools                 ptxas (the PTX to SASS assembler) and nvdisasm in
#                                      .cache/, their directory in SDP4BIT_CUDA_BIN: the kernel
#                                      resource checks of tests/cuda_compile.rs and the table of
#                                      bench/kernels.rs (no GPU needed)

SDP4BIT_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
SDP4BIT_MAIN_VENV="$SDP4BIT_ROOT/.cache/venv"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore PIP_NO_INPUT=1
# The environments are made once and kept (a stamp per requirements file), so pip's cache of
# downloaded wheels (gigabytes of CUDA libraries per torch) would only fill the disk.
export PIP_NO_CACHE_DIR=1
# DeepSpeed JIT-builds its CPU communication op (with ninja, from the environment) on first use;
# the build is kept with the project rather than in the home directory.
export TORCH_EXTENSIONS_DIR="$SDP4BIT_ROOT/.cache/torch_extensions"

sdp4bit_venv() {
  local dir=$1
  shift
  local stamp="$dir/.sdp4bit-requirements"
  local python=${SDP4BIT_VENV_PYTHON:-python3}
  local want
  want=$(cd "$SDP4BIT_ROOT" && "$python" --version && sha256sum "$@")
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x "$dir/bin/python" ]; then
    return 0
  fi
  if [ -x "$dir/bin/python" ] && [ "$("$dir/bin/python" --version)" != "$("$python" --version)" ]; then
    echo "   $dir has $("$dir/bin/python" --version), not $("$python" --version): made again"
    rm -rf "$dir"
  fi
  if [ ! -x "$dir/bin/python" ]; then
    echo "   creating the virtual environment $dir ($("$python" --version))"
    "$python" -m venv "$dir"
  fi
  echo "   installing $1 into $dir"
  "$dir/bin/python" -m pip install --quiet -r "$SDP4BIT_ROOT/$1"
  if [ $# -gt 1 ]; then
    echo "   installing $2 into $dir (no build isolation, no ops compiled)"
    DS_BUILD_OPS=0 "$dir/bin/python" -m pip install --quiet --no-build-isolation \
      -r "$SDP4BIT_ROOT/$2"
  fi
  echo "$want" > "$stamp"
}

# A Python 3.12 interpreter with venv (on PATH, else pyenv's), for the environment of the
# newest torch; prints its path, or fails when the machine has none.
sdp4bit_python312() {
  local found
  for found in "$(command -v python3.12 || true)" "$HOME"/.pyenv/versions/3.12*/bin/python3.12; do
    if [ -x "$found" ] && "$found" -c 'import ensurepip, venv' 2>/dev/null; then
      echo "$found"
      return 0
    fi
  done
  return 1
}

sdp4bit_use() {
  export VIRTUAL_ENV=$1
  export PATH="$1/bin:$PATH"
  hash -r
}

sdp4bit_torch_view() {
  local dir=$1 from=$2
  rm -rf "$dir"
  "$from/bin/python" -m venv --without-pip "$dir"
  local theirs ours
  theirs=$("$from/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  ours=$("$dir/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  local entry
  for entry in "$theirs"/*; do
    case $(basename "$entry") in
      sdp4bit|sdp4bit-*|megatron_patch|__pycache__) ;;
      *) ln -s "$entry" "$ours/" ;;
    esac
  done
  # The ninja package's program lives in bin/ (torch's extension builder runs it).
  if [ -x "$from/bin/ninja" ]; then ln -s "$from/bin/ninja" "$dir/bin/ninja"; fi
}

sdp4bit_main_venv() {
  sdp4bit_venv "$SDP4BIT_MAIN_VENV" requirements-test.txt requirements-deepspeed.txt
  sdp4bit_use "$SDP4BIT_MAIN_VENV"
}

# The sources a package install is built from, as one hash of the files as they are now
# (tracked or new) and of SDP4BIT_TEST_OPS (scripts/build_native.py); empty outside a git
# checkout. An install into a virtual environment records
# it (sdp4bit_record_install DIR [HASH]: the hash taken when the build began, else now), and
# the main job reinstalls only when the tree has changed.
SDP4BIT_PACKAGE_SOURCES=(Cargo.toml Cargo.lock build.rs .cargo setup.py pyproject.toml
  MANIFEST.in src cpp kernels sdp4bit megatron_patch scripts/build_native.py
  scripts/glibc_floor.py)

sdp4bit_source_hash() {
  (cd "$SDP4BIT_ROOT" && git rev-parse --git-dir >/dev/null 2>&1 \
    && { git ls-files -z --cached --others --exclude-standard -- "${SDP4BIT_PACKAGE_SOURCES[@]}" \
      | sort -z | xargs -0 sha256sum; echo "SDP4BIT_TEST_OPS=${SDP4BIT_TEST_OPS:-}"; } \
    | sha256sum | cut -d' ' -f1)
}

sdp4bit_install_current() {
  if sdp4bit_installed_is_current "$VIRTUAL_ENV"; then
    echo "   sdp4bit is installed from the sources as they are"
    return 0
  fi
  echo "   pip install . (cargo builds the Rust core, then the torch extension)"
  # The sources' hash as the build starts: a tree changed while it builds is not recorded as
  # installed, so the next call builds again.
  local before
  before=$(sdp4bit_source_hash)
  (cd "$SDP4BIT_ROOT" && rm -rf build && pip install --quiet --no-deps --force-reinstall .) \
    || return 1
  sdp4bit_record_install "$VIRTUAL_ENV" "$before"
}

SDP4BIT_NVRTC_VERSION=13.0.88

sdp4bit_nvrtc() {
  local prefix="$SDP4BIT_ROOT/.cache/nvrtc-$SDP4BIT_NVRTC_VERSION"
  if [ ! -f "$prefix/nvidia/cu13/lib/libnvrtc.so.13" ]; then
    python3 -m pip install --quiet --no-deps --target "$prefix" \
      "nvidia-cuda-nvrtc==$SDP4BIT_NVRTC_VERSION"
  fi
  export LD_LIBRARY_PATH="$prefix/nvidia/cu13/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
}

# ptxas of the NVRTC release above; nvdisasm (SASS text) from its oldest wheel on PyPI, which
# reads the sm_90 code ptxas 13.0 writes.
SDP4BIT_PTXAS_VERSION=13.0.88
SDP4BIT_NVDISASM_VERSION=13.2.51

sdp4bit_cuda_tools() {
  local prefix="$SDP4BIT_ROOT/.cache/cuda-tools-$SDP4BIT_PTXAS_VERSION"
  if [ ! -x "$prefix/nvidia/cu13/bin/ptxas" ] || [ ! -x "$prefix/nvidia/cu13/bin/nvdisasm" ]; then
    python3 -m pip install --quiet --no-deps --target "$prefix" \
      "nvidia-cuda-nvcc==$SDP4BIT_PTXAS_VERSION" "nvidia-cuda-nvdisasm==$SDP4BIT_NVDISASM_VERSION"
  fi
  export SDP4BIT_CUDA_BIN="$prefix/nvidia/cu13/bin"
}

sdp4bit_record_install() {
  echo "${2:-$(sdp4bit_source_hash)}" > "$1/.sdp4bit-installed-source"
}

sdp4bit_installed_is_current() {
  local now
  now=$(sdp4bit_source_hash)
  [ -n "$now" ] && [ -f "$1/.sdp4bit-installed-source" ] \
    && [ "$(cat "$1/.sdp4bit-installed-source")" = "$now" ]
}

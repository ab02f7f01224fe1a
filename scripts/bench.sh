#!/usr/bin/env bash
# Runs one of the benchmark programs of bench/ (bench/README.md) with what it needs set up:
#
#   bash scripts/bench.sh cpu [ARGS]           cargo bench --bench cpu (fused passes, collectives)
#   bash scripts/bench.sh gpu [ARGS]           cargo bench --bench gpu (kernels; needs a GPU)
#   bash scripts/bench.sh kernels [ARGS]       cargo bench --bench kernels (static model of the
#                                              kernels from their SASS; no GPU)
#   bash scripts/bench.sh cluster [ARGS]       python bench/cluster.py (emulated cluster; root)
#   bash scripts/bench.sh cluster_phases [ARGS]  python bench/cluster_phases.py (each rank's
#                                              phase times on the emulated cluster; root)
#   bash scripts/bench.sh cluster_cpu [ARGS]   python bench/cluster_cpu.py (each rank's CPU per
#                                              preset on the emulated cluster; root)
#   bash scripts/bench.sh cluster_hybrid [ARGS]  python bench/cluster_hybrid.py (hybrid
#                                              sharding's steps and link bytes; root)
#   bash scripts/bench.sh convergence [ARGS]   python bench/convergence.py (convergence study)
#   bash scripts/bench.sh convergence_long [ARGS]  python bench/convergence_long.py (the long
#                                              study, with its controls)
#   bash scripts/bench.sh convergence_reproduce [ARGS]  python bench/convergence_reproduce.py
#                                              (the kept study's runs rerun on the tree)
#   bash scripts/bench.sh hadamard_real [ARGS] python bench/hadamard_real.py (the Hadamard
#                                              transform on real gradients)
#
# The Rust benchmarks get NVRTC on LD_LIBRARY_PATH (and the kernel model ptxas and nvdisasm);
# the Python harnesses run from the project's virtual environment (its bin first on PATH,
# scripts/env.sh) with sdp4bit installed from the tree as it is.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
name=${1:?usage: bash scripts/bench.sh cpu|gpu|kernels|cluster|cluster_cpu|cluster_hybrid|cluster_phases|convergence|convergence_long|convergence_reproduce|hadamard_real [ARGS]}
shift
case "$name" in
  cpu | gpu)
    sdp4bit_nvrtc
    exec cargo bench --locked --bench "$name" -- "$@"
    ;;
  kernels)
    sdp4bit_nvrtc
    sdp4bit_cuda_tools
    exec cargo bench --locked --bench kernels -- "$@"
    ;;
  cluster | cluster_cpu | cluster_hybrid | cluster_phases | convergence | convergence_long | convergence_reproduce | hadamard_real)
    sdp4bit_main_venv
    sdp4bit_install_current
    exec python "bench/$name.py" "$@"
    ;;
  *)
    echo "unknown benchmark '$name': cpu, gpu, kernels, cluster, cluster_cpu, cluster_hybrid, cluster_phases, convergence, convergence_long, convergence_reproduce or hadamard_real" >&2
    exit 2
    ;;
esac

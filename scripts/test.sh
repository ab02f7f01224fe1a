#!/usr/bin/env bash
# The project's test command: formatting, lints, every Rust test, and a smoke run of the CPU
# benchmark. Needs only a Rust toolchain (cargo fetches the pinned crates from Cargo.lock).
set -euo pipefail
cd "$(dirname "$0")/.."

echo "== cargo fmt --check"
cargo fmt --all -- --check
echo "== cargo clippy -D warnings"
cargo clippy --locked --release --all-targets -- -D warnings
echo "== cargo test"
cargo test --locked --release
echo "== benchmark smoke run (SDP4BIT_BENCH_QUICK=1)"
SDP4BIT_BENCH_QUICK=1 cargo bench --locked --bench cpu

//! Bit-identity of every CUDA kernel with the CPU backend, without a GPU: g++ compiles the
//! kernels of `kernels/` unchanged against a host emulation of the CUDA device environment
//! (`tests/kernel_emulator/`, driven by [`emulator`]), and the emulator runs launches whose
//! outputs must be the CPU backend's.
//!
//! One test per codec family (beside its cases in [`emulator`]'s `grad`, `weight` and `global`),
//! each with fresh random inputs (fixed seed, per family), launch
//! parameters built by the CUDA backend's own `abi` constructors, grids of 1, 2 or 3 blocks
//! (so the grid-stride loops run) or as many blocks as the work units need, warps in forward,
//! reverse or shuffled order. The data hold NaN / Inf groups, signed zeros, denormals, values
//! near `f32::MAX` and odd shard sizes. The families:
//! - gradients, per codec (TLq-HS: H16, H32, H64 with 4/8-bit nearest, H256 over 512- and
//!   768-element groups, 32-element groups; TLq: 96-element groups, 4/8-bit nearest; ZeRO++;
//!   QSDP: 8-bit and 4-bit, nearest and stochastic): topologies 2x2, 2x2 with interleaved
//!   ranks, 1x4, 4x1, 2x3, 3x2 interleaved and two with unequal nodes; P = 1 and 3; all three
//!   passes;
//! - weights, per codec (qwd, qw, qsdp, zeropp) with several bit widths, group sizes and
//!   roundings, W = 1 to 4: encode (also at a bucket index past 2^32 Philox blocks) and apply;
//! - Global-QSGD: absmax, int8 / int16 rounding (stochastic and nearest) and dequantization;
//! - the gradient kernels' bf16 variants (bf16 bucket in, bf16 shard out) beside their fp32
//!   ones in the gradient and Global-QSGD families, and the bf16 conversions.
//!
//! Every gradient and weight case also feeds its decoding kernels corrupt received slabs
//! (negative or infinite scales, infinite offsets, the symmetric code -2^(b-1)), which the
//! kernels decode to NaN where the CPU returns `Error::Decode`: the expected output is the
//! CPU's for the same slabs with those groups made non-finite (scale and offset NaN, codes 0);
//! and unusual but valid metadata (scale -0, a negative NaN, a denormal) that both must decode
//! alike.
//!
//! The default run is a third of each family's cross product that still covers every axis;
//! `SDP4BIT_EMULATOR_FULL=1` runs the whole of it (801 cases). g++ is required (it builds the
//! emulator once for all families): without it the tests fail, unless
//! `SDP4BIT_SKIP_EMULATOR=1`. `SDP4BIT_KERNELS_DIR=DIR` emulates the kernel sources in DIR
//! instead of `kernels/` (e.g. a deliberately broken copy), and `SDP4BIT_TEST_SEED=N` changes
//! the data seed. On failure the family's work directory (case files, outputs, the emulator)
//! is kept and its path printed.

use std::path::Path;

use sdp4bit::backend::cuda::source::Kernel;

mod divide;
mod emulator;

/// Every kernel is launched by some emulated family: its parameter struct is named in one of
/// the family struct lists of `emulator/` (each family's cases must then launch it, which
/// `emulate_family` checks). Shown to fail on a table line whose struct no family names.
#[test]
fn every_kernel_belongs_to_an_emulated_family() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/cuda_emulated/emulator");
    let mut named = String::new();
    for entry in std::fs::read_dir(&dir).expect("tests/cuda_emulated/emulator") {
        let path = entry.expect("directory entry").path();
        named += &std::fs::read_to_string(&path).expect("a family source");
    }
    let missing: Vec<&str> = Kernel::ALL
        .into_iter()
        .filter(|k| !named.contains(&format!("\"{}\"", k.params())))
        .map(Kernel::name)
        .collect();
    assert!(
        missing.is_empty(),
        "no emulated family launches {missing:?} (name its parameter struct in a family's list)"
    );
}

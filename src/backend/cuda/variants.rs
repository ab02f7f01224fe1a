//! Which [`Variant`] a kernel launches with, and the variants worth timing. Every variant
//! computes the same bytes, so the choice only moves speed.
//!
//! A variant's register budget (`min_blocks`, the blocks per multiprocessor its
//! `__launch_bounds__` asks for) follows from an estimate of the registers a thread of the
//! specialisation needs ([`registers`]): what it holds per unit of work (a group's values, the
//! loads of a batch of peers, Philox words drawn early), times the units, over a base for its
//! addresses, loop state and temporaries. The estimates are fitted to ptxas's counts of the
//! cover's specialisations, and `tests/cuda_compile.rs` checks that none of them spills.

use super::compile::Arch;
use super::source::Kernel;
use super::spec::{Constants, DEFAULT_GRID_BLOCKS, Quant, Variant};

/// One line of the table: the variant of `kernel` with `constants` that the GPU kit's sweep
/// measured fastest on an architecture, and the report it comes from.
#[derive(Debug, Clone, Copy)]
pub struct Measured {
    pub kernel: Kernel,
    pub constants: Constants,
    pub variant: Variant,
    /// The report under bench/results/gpu/ that measured it.
    pub report: &'static str,
}

/// The committed table: per architecture, the variants measured fastest there. An
/// architecture listed uses its lines and the default for the rest; one not listed is tuned at
/// first use ([`super::autotune`]).
///
/// sm_90 (H100, H200): no specialised kernel has run on a GPU yet (the H100's runs of
/// bench/results/gpu/ timed the kernels before specialisation), so it has no line and every
/// kernel takes the default, the model's choice (bench/results/kernels.md). The GPU kit's sweep
/// (`scripts/gpu_kit.sh run`, stage `sweep`) prints the lines to commit here.
pub const TABLE: &[(Arch, &[Measured])] = &[(Arch::SM_90, &[])];

/// Whether `arch` has lines in [`TABLE`] (and so is not tuned at first use).
pub fn in_table(arch: Arch) -> bool {
    TABLE.iter().any(|(a, _)| *a == arch)
}

/// The table's variant of `kernel` with `constants` on `arch`, if it has one.
pub fn table_variant(arch: Arch, kernel: Kernel, constants: Constants) -> Option<Variant> {
    TABLE
        .iter()
        .filter(|(a, _)| *a == arch)
        .flat_map(|(_, lines)| lines.iter())
        .find(|m| m.kernel == kernel && m.constants == constants)
        .map(|m| m.variant)
}

/// Registers a default variant may plan for: three blocks of 256 threads per multiprocessor.
/// The default takes the most groups per warp that fit it (several groups' loads in flight),
/// or one group with a larger budget.
const DEFAULT_REGISTERS: u32 = 80;

/// Registers one thread of `kernel` with `constants` needs with `units` groups per warp (runs
/// per thread for the element-wise kernels).
pub fn registers(kernel: Kernel, constants: Constants, units: u32) -> u32 {
    let e = constants.lane_elements();
    let values = |q: Quant| if q.held(e) { q.rows(e) * e } else { 32 };
    // Past 32 held values the transforms' and the codes' temporaries no longer fit beside them.
    let crowded = |held: u32| if held > 32 { held / 2 } else { 0 };
    match constants {
        Constants::First { quant, .. } => {
            let held = units * values(quant);
            // The Philox words are drawn while the loads fly when they fit 32 registers.
            let words = if quant.stochastic && held <= 32 {
                held
            } else {
                0
            };
            48 + held + words + crowded(held)
        }
        Constants::Second {
            output: quant,
            peer_batch,
            ..
        }
        | Constants::Final {
            quant, peer_batch, ..
        } => {
            // Per peer: its scale, its address and a code word per row.
            let rows = if quant.held(e) { quant.rows(e) } else { 32 / e };
            let loads = peer_batch * (2 + rows);
            let rows_stage = match constants {
                Constants::Final { hadamard_block, .. } if hadamard_block > 32 * e => 8,
                _ => 0,
            };
            let held = units * values(quant);
            32 + held + units * loads + rows_stage + crowded(held)
        }
        Constants::Weight { quant, .. } => {
            // The held bf16 vectors of both inputs (encode) or the old params and the code
            // words (apply): eight and five registers per row of eight elements.
            let per_row = if kernel == Kernel::WeightEncode { 8 } else { 5 };
            60 + units * (values(quant) / e) * per_row
        }
        Constants::Elementwise { .. } => {
            let base = match kernel {
                Kernel::GlobalDequantizeI8 | Kernel::GlobalDequantizeI8Bf16 => 40,
                Kernel::GlobalDequantizeI16 | Kernel::GlobalDequantizeI16Bf16 => 48,
                _ => 32,
            };
            base + (units - 1) * 12
        }
    }
}

/// The most blocks of `threads` threads per multiprocessor (at most 2048 threads in all) whose
/// register budget, 65536 registers over them rounded down to the allocation unit of 8 and at
/// most 255, holds `registers`; at least 1.
pub fn min_blocks(threads: u32, registers: u32) -> u32 {
    (1..=2048 / threads)
        .rev()
        .find(|&blocks| (65_536 / (threads * blocks) / 8 * 8).min(255) >= registers)
        .unwrap_or(1)
}

/// The default variant of `kernel` with `constants`: blocks of 256 threads, the most of 4, 2 and
/// 1 units whose registers fit `DEFAULT_REGISTERS` (1 for a group walked in tiles and for the
/// element-wise kernels), and the register budget those units need.
pub fn default_variant(kernel: Kernel, constants: Constants) -> Variant {
    let units = match constants {
        Constants::Elementwise { .. } => 1,
        _ => [4, 2, 1]
            .into_iter()
            .find(|&u| {
                let v = variant(kernel, constants, u, 256);
                v.check(constants).is_ok() && registers(kernel, constants, u) <= DEFAULT_REGISTERS
            })
            .unwrap_or(1),
    };
    variant(kernel, constants, units, 256)
}

/// `units` and `threads` with the register budget they need and the default grid cap.
fn variant(kernel: Kernel, constants: Constants, units: u32, threads: u32) -> Variant {
    Variant {
        units,
        threads,
        min_blocks: min_blocks(threads, registers(kernel, constants, units)),
        grid_blocks: DEFAULT_GRID_BLOCKS,
    }
}

/// Every variant of `kernel` with `constants` worth timing: 1, 2, 4 and 8 units (groups per
/// warp, runs per thread) where they fit, blocks of 128, 256 and 512 threads, each with the
/// register budget it needs, and grids of 1, 2 and 4 blocks per multiprocessor of the default
/// shape. The default is among them.
pub fn candidates(kernel: Kernel, constants: Constants) -> Vec<Variant> {
    let default = default_variant(kernel, constants);
    let mut out = Vec::new();
    for units in [1, 2, 4, 8] {
        for threads in [128, 256, 512] {
            let v = variant(kernel, constants, units, threads);
            if v.check(constants).is_ok() && !out.contains(&v) {
                out.push(v);
            }
        }
    }
    for grid_blocks in [1, 2, 4] {
        out.push(Variant {
            grid_blocks,
            ..default
        });
    }
    if !out.contains(&default) {
        out.push(default);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn quant(bits: u32, group_size: u32) -> Quant {
        Quant {
            bits,
            group_size,
            symmetric: true,
            stochastic: true,
        }
    }

    /// Every default and candidate variant is one the kernels compile, and small groups share
    /// a warp.
    #[test]
    fn defaults_compile_and_fill_warps() {
        for group_size in [32, 96, 128, 256, 1024, 2048, 4096, 65536] {
            let q = quant(8, group_size);
            for (kernel, constants) in [
                (
                    Kernel::GradQuantizeFirst,
                    Constants::First {
                        quant: q,
                        hadamard_block: 0,
                    },
                ),
                (
                    Kernel::GradRequantizeSecond,
                    Constants::Second {
                        input: q,
                        output: q,
                        peer_batch: 2,
                    },
                ),
                (
                    Kernel::GradReduceFinal,
                    Constants::Final {
                        quant: q,
                        hadamard_block: 0,
                        peer_batch: 8,
                    },
                ),
                (
                    Kernel::WeightEncode,
                    Constants::Weight {
                        quant: q,
                        difference: true,
                    },
                ),
            ] {
                let default = default_variant(kernel, constants);
                default.check(constants).unwrap();
                let all = candidates(kernel, constants);
                assert!(all.contains(&default));
                assert!(all.iter().all(|v| v.check(constants).is_ok()));
            }
        }
        let first = Constants::First {
            quant: quant(8, 128),
            hadamard_block: 32,
        };
        assert_eq!(default_variant(Kernel::GradQuantizeFirst, first).units, 4);
        let weights = Constants::Weight {
            quant: quant(4, 2048),
            difference: true,
        };
        let encode = default_variant(Kernel::WeightEncode, weights);
        assert_eq!((encode.units, encode.min_blocks), (1, 2));
    }

    /// The register budget holds the estimate: 3 blocks of 256 threads give 80, 2 give 128.
    #[test]
    fn blocks_follow_the_registers() {
        assert_eq!(min_blocks(256, 80), 3);
        assert_eq!(min_blocks(256, 81), 2);
        assert_eq!(min_blocks(256, 32), 8);
        assert_eq!(min_blocks(128, 32), 16);
        assert_eq!(min_blocks(512, 200), 1);
        assert_eq!(min_blocks(256, 300), 1);
    }
}

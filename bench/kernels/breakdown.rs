//! Where a kernel's warp instructions go: each instruction attributed by its opcode (the
//! convergence-region bookkeeping) or else by the function of `kernels/` its innermost source
//! line lies in, the functions grouped into categories. The lists name the functions of both
//! builds, c4b4d29's and the current one (a member function as `struct::name`).

use std::collections::HashMap;

use sdp4bit_test_support::sass::Listing;

/// The category of the instructions that open, close and repair convergence regions
/// (`BSSY`, `BSYNC`, `BRA.DIV`, `WARPSYNC`): what a warp-wide operation under a run-time
/// condition costs besides itself.
pub const DIVERGENCE: &str = "convergence regions (BSSY, BSYNC, BRA.DIV, WARPSYNC)";

/// The categories, each with the functions of `kernels/` whose instructions it counts; the
/// kernel's own function and anything unlisted fall into the last.
pub const CATEGORIES: [(&str, &[&str]); 13] = [
    (DIVERGENCE, &[]),
    (
        "Philox rounds",
        &[
            "sdp_philox",
            "sdp_words4",
            "sdp_uniforms4",
            "global_words",
            "sdp_run_words",
        ],
    ),
    (
        "uniform add, rounding, clamp",
        &[
            "sdp_add_uniform",
            "sdp_word_to_uniform",
            "sdp_code_of",
            "sdp_round_clamp",
            "global_code",
        ],
    ),
    (
        "division by the scale",
        &[
            "sdp_divide_run",
            "sdp_divide_markstein",
            "sdp_divide_fast",
            "sdp_divide_plain4",
            "sdp_divisor_unbounded",
        ],
    ),
    (
        "scale and reciprocal (per group)",
        &[
            "sdp_meta_of",
            "sdp_meta_any",
            "sdp_meta_general",
            "sdp_meta_non_finite",
            "sdp_max_code_inverse",
            "sdp_divisor_uncoded",
            "sdp_divisor_of",
            "sdp_is_finite",
        ],
    ),
    (
        "statistics (absmax, warp reduction)",
        &[
            "sdp_stats_add",
            "sdp_stats_reduce",
            "sdp_stats_empty",
            "sdp_warp_max_u32",
            "sdp_warp_min",
            "sdp_warp_max",
            "sdp_abs_bits",
        ],
    ),
    (
        "Hadamard (shuffles, butterflies)",
        &[
            "sdp_hadamard_forward",
            "sdp_hadamard_inverse",
            "sdp_hadamard_lane_stage",
            "sdp_hadamard_register_stage",
            "sdp_power_of_two_inverse",
        ],
    ),
    (
        "code packing and stores",
        &[
            "sdp_store_codes",
            "sdp_zero_slab_padding",
            "sdp_zero_slabs_padding",
            "sdp_store_run_codes",
            "sdp_store_meta",
        ],
    ),
    (
        "quantizer control (tiles, runs)",
        &[
            "sdp_quantize_group",
            "sdp_quantize_held",
            "sdp_quantize_tiled",
            "sdp_encode_rows",
            "sdp_rows_of",
        ],
    ),
    (
        "decoding (code loads, checks, dequantize, peer sums)",
        &[
            "sdp_load_run_codes",
            "sdp_run_codes_at",
            "sdp_decode_run_codes",
            "sdp_run_codes_corrupt",
            "sdp_zero_field_borrows",
            "sdp_byte_0x80_marks",
            "sdp_code_marks_found",
            "sdp_nibble_as_float",
            "sdp_byte_as_float",
            "sdp_peer_meta",
            "sdp_dequantize",
            "sdp_sum_peers_tile",
            "sdp_slab_group",
            "sdp_meta_corrupt",
            "sdp_is_inf",
            "global_load_sums",
            "global_outside",
            "global_code_max",
            "sdp_run_codes::offset",
            "sdp_run_codes::shift",
            "sdp_run_codes::load",
            "sdp_run_codes::decode",
            "sdp_run_codes::corrupt",
            "sdp_load_group_scale",
            "sdp_scale_corrupt",
            "sdp_checked_scale",
            "sdp_peer_group::load",
            "sdp_peer_group::meta_corrupt",
            "sdp_peer_group::scale",
            "sdp_peer_group::row_values",
            "sdp_peer_group::add_to",
            "sdp_sum_peers",
            "group_loads::apply",
        ],
    ),
    (
        "element loads and stores",
        &[
            "sdp_load_f32x4",
            "sdp_grad_load4",
            "sdp_grad_load4_raw",
            "sdp_grad_to_f32",
            "sdp_store_f32x4",
            "sdp_load_u16x8",
            "sdp_store_u16x8",
            "sdp_bf16_to_f32",
            "sdp_bf16_low_to_f32_raw",
            "sdp_bf16_high_to_f32_raw",
            "sdp_f32_to_bf16",
            "sdp_f32x2_to_bf16x2",
            "sdp_grad_store4",
            "sdp_grad_store1",
            "sdp_grad_run_aligned",
            "sdp_half",
            "sdp_word_of",
            "sdp_aligned",
            "load_run",
            "load_four",
            "load_four_of_part",
            "element_of",
            "store_tile",
            "store_run_elements",
            "store_group_nan",
            "global_load_run",
            "global_store_run",
            "global_quantize_checked",
            "apply_run",
            "load_rows",
            "store_rows",
            "apply_vector",
            "apply_elements",
            "group_loads::load",
            "held_runs::load",
            "held_runs::values",
            "load_eight",
        ],
    ),
    (
        "unit index and addresses",
        &[
            "sdp_warp_id",
            "sdp_warp_count",
            "sdp_thread_id",
            "sdp_thread_count",
            "sdp_unit_walk_of",
            "sdp_unit_walk_next",
            "sdp_digits_of",
            "sdp_lane",
            "sdp_slab_at",
            "sdp_codes_offset",
            "sdp_scale_offset",
            "sdp_offset_offset",
            "sdp_meta_end",
            "sdp_code_bytes",
            "sdp_max_code",
            "sdp_tiles",
            "sdp_tile_element",
            "sdp_tile_runs",
            "sdp_run_in_group",
            "sdp_quantize_slab_group",
            "global_runs",
            "sdp_rows::in_group",
            "sdp_rows::element",
        ],
    ),
    ("the kernel's own code (loops, branches, its lambdas)", &[]),
];

/// Executions (`counts`, one per instruction of `listing`) summed per category of
/// [`CATEGORIES`]; `sources` holds every file the frames name, by base name.
pub fn by_category(
    listing: &Listing,
    counts: &[f64],
    sources: &HashMap<String, String>,
) -> Vec<f64> {
    let mut out = vec![0.0; CATEGORIES.len()];
    for (ins, &n) in listing.instructions.iter().zip(counts) {
        if n == 0.0 {
            continue;
        }
        let divergence = matches!(ins.base(), "BSSY" | "BSYNC" | "WARPSYNC")
            || ins.opcode.starts_with("BRA.DIV");
        let category = if divergence {
            0
        } else {
            ins.frames
                .first()
                .and_then(|f| function_at(sources.get(&f.file)?, f.line))
                .and_then(|name| {
                    CATEGORIES
                        .iter()
                        .position(|(_, fs)| fs.contains(&name.as_str()))
                })
                .unwrap_or(CATEGORIES.len() - 1)
        };
        out[category] += n;
    }
    out
}

/// The function of `source` that line `line` (1-based) lies in: the name of the last
/// definition that starts at or before it (a line beginning with `__device__`, `static
/// __device__` or, for kernels, `extern "C"` with the name on the next line); a member
/// function (indented, in a `struct` opened at the start of a line) as `struct::name`.
fn function_at(source: &str, line: u32) -> Option<String> {
    let lines: Vec<&str> = source.lines().collect();
    let mut name = None;
    let mut within: Option<&str> = None;
    for (i, text) in lines.iter().enumerate().take(line as usize) {
        if let Some(rest) = text.strip_prefix("struct ") {
            within = rest.split_whitespace().next();
            continue;
        }
        if text.starts_with("};") {
            within = None;
            continue;
        }
        let member = text.trim_start();
        let header = if text.starts_with("extern \"C\"") {
            lines.get(i + 1).copied()
        } else if text.starts_with("__device__") || text.starts_with("static __device__") {
            Some(*text)
        } else if within.is_some()
            && member.len() < text.len()
            && (member.starts_with("__device__") || member.starts_with("static __device__"))
        {
            Some(member)
        } else {
            None
        };
        if let Some(found) = header
            .and_then(|h| h.split('(').next())
            .and_then(|h| h.split_whitespace().last())
        {
            name = Some(match within {
                Some(s) if text.len() > member.len() => format!("{s}::{found}"),
                _ => found.to_owned(),
            });
        }
    }
    name
}

//! The first difference between an output the emulated kernels wrote and the CPU backend's,
//! described: codes and padding byte for byte, fp32 and bf16 values bit for bit with NaN
//! compared as NaN-ness (a GPU's NaN payloads differ from the host's).

use half::bf16;
use sdp4bit::backend::cuda::abi::overflow_from_status;
use sdp4bit::backend::cuda::absmax_from_bits;
use sdp4bit::codec::slab::SlabLayout;

use super::case::Expect;

fn f32_at(bytes: &[u8], i: usize) -> f32 {
    f32::from_le_bytes(bytes[4 * i..4 * i + 4].try_into().expect("4 bytes"))
}

fn same_f32(a: f32, b: f32) -> bool {
    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
}

/// The first difference between the CPU's bytes `cpu` and the emulated `emu` of one output,
/// described, or `None` when they agree.
pub(crate) fn first_difference(expect: Expect, cpu: &[u8], emu: &[u8]) -> Option<String> {
    match expect {
        Expect::Slabs(layout) => slab_difference(layout, cpu, emu),
        Expect::F32 => (0..cpu.len() / 4)
            .find(|&i| !same_f32(f32_at(cpu, i), f32_at(emu, i)))
            .map(|i| {
                let (c, e) = (f32_at(cpu, i), f32_at(emu, i));
                format!(
                    "element {i}: cpu {c:e} ({:#010x}), emulated {e:e} ({:#010x})",
                    c.to_bits(),
                    e.to_bits()
                )
            }),
        Expect::Bf16 => {
            let at =
                |b: &[u8], i: usize| bf16::from_bits(u16::from_le_bytes([b[2 * i], b[2 * i + 1]]));
            (0..cpu.len() / 2)
                .find(|&i| {
                    let (c, e) = (at(cpu, i), at(emu, i));
                    c.to_bits() != e.to_bits() && !(c.is_nan() && e.is_nan())
                })
                .map(|i| {
                    let (c, e) = (at(cpu, i), at(emu, i));
                    format!(
                        "element {i}: cpu {c} ({:#06x}), emulated {e} ({:#06x})",
                        c.to_bits(),
                        e.to_bits()
                    )
                })
        }
        Expect::Ints(width) => {
            let at = |b: &[u8], i: usize| match width {
                1 => i64::from(b[i] as i8),
                _ => i64::from(i16::from_le_bytes([b[2 * i], b[2 * i + 1]])),
            };
            (0..cpu.len() / width)
                .find(|&i| at(cpu, i) != at(emu, i))
                .map(|i| format!("element {i}: cpu {}, emulated {}", at(cpu, i), at(emu, i)))
        }
        Expect::AbsmaxBits => {
            let word = |b: &[u8]| u32::from_le_bytes(b[..4].try_into().expect("4 bytes"));
            let (c, e) = (f32::from_bits(word(cpu)), absmax_from_bits(word(emu)));
            (c.to_bits() != e.to_bits()).then(|| {
                format!(
                    "absmax: cpu {c:e}, emulated {e:e} (bits {:#010x})",
                    word(emu)
                )
            })
        }
        Expect::OverflowStatus(numel) => {
            let word = |b: &[u8]| u32::from_le_bytes(b[..4].try_into().expect("4 bytes"));
            let (c, e) = (word(cpu), word(emu));
            (c != e).then(|| {
                format!(
                    "status word: cpu {c:#010x} {:?}, emulated {e:#010x} {:?} ((block, element) of the first overflow)",
                    overflow_from_status(c, numel),
                    overflow_from_status(e, numel)
                )
            })
        }
    }
}

/// Codes exactly, scales and offsets as floats (NaN as NaN-ness), padding exactly.
fn slab_difference(layout: SlabLayout, cpu: &[u8], emu: &[u8]) -> Option<String> {
    let code_bytes = layout.spec.code_bytes_per_group();
    let codes_len = layout.codes_len();
    let meta_end = codes_len + 4 * layout.groups * layout.spec.meta_words();
    for (s, (c, e)) in cpu
        .chunks_exact(layout.byte_len())
        .zip(emu.chunks_exact(layout.byte_len()))
        .enumerate()
    {
        if let Some(i) = (0..codes_len).find(|&i| c[i] != e[i]) {
            let k = i / code_bytes;
            let scale = |b: &[u8]| f32_at(&b[codes_len..], k);
            return Some(format!(
                "slab {s} group {k}: codes differ at byte {} of the group: cpu {:#04x}, \
                 emulated {:#04x} (cpu scale {:e}, emulated scale {:e})",
                i % code_bytes,
                c[i],
                e[i],
                scale(c),
                scale(e)
            ));
        }
        for w in 0..(meta_end - codes_len) / 4 {
            let (a, b) = (f32_at(&c[codes_len..], w), f32_at(&e[codes_len..], w));
            if !same_f32(a, b) {
                let (what, k) = if w < layout.groups {
                    ("scale", w)
                } else {
                    ("offset", w - layout.groups)
                };
                return Some(format!(
                    "slab {s} group {k}: {what} cpu {a:e} ({:#010x}), emulated {b:e} ({:#010x})",
                    a.to_bits(),
                    b.to_bits()
                ));
            }
        }
        if let Some(i) = (meta_end..c.len()).find(|&i| c[i] != e[i]) {
            return Some(format!(
                "slab {s}: padding byte {} is {:#04x}, expected {:#04x}",
                i - meta_end,
                e[i],
                c[i]
            ));
        }
    }
    None
}

//! The kernels' division helpers against Rust, on the host: g++ builds
//! `tests/kernel_emulator/divide.cpp` (which calls `kernels/divide.cuh`'s `sdp_divisor_of` and
//! `sdp_divide_run`, with the emulator's `cuda_shim.h`) into a shared library, and every
//! quotient must equal Rust's `/` bit for bit (NaN as NaN-ness: its payload is the hardware's).
//!
//! `sdp_divide_run` replaces the IEEE division `x / s` of the quantizer by a reciprocal and two
//! fused multiply-adds where Markstein's theorem holds (docs/numerics.md §1.4), so the inputs
//! cover the edges of its conditions and of fp32: every pair of a list of edge values (signed
//! zeros, subnormals, the limits 2^-60, 2^60, 2^-40, 2^40 and their neighbours, the largest
//! finite value, Inf, NaN), every pair of exponents with random mantissas, every mantissa of
//! x against divisors with extreme mantissas, random bit patterns, and the quantizer's own
//! quotients (x in [-absmax, absmax], s = absmax / L for every code limit L): 570 million
//! quotients in all.
//!
//! Global-QSGD divides by a scale that bounds no value (`sdp_divisor_unbounded`), so its runs
//! check both limits of |x| per value (`sdp_divide_run<N, true>`): the same kinds of inputs,
//! with runs that mix values inside and outside the fast path's range and no bound, and
//! Global-QSGD's own quotients (x in [-absmax, absmax], s = absmax / K for K = 127 and 32767):
//! 135 million quotients.
//!
//! Two more exact replacements are checked here exhaustively: the packed rounding of two fp32
//! to bf16 (`sdp_f32x2_to_bf16x2`) against the CPU reference's rounding (`half`) for every fp32
//! bit pattern, and the decoding of a nibble in place (`sdp_nibble_as_float`) against the nibble
//! shifted down and converted, for every position, bias and half-word.
//!
//! The quantizer's metadata (`sdp_meta_of`) takes an inline fast path for symmetric groups of 4-
//! or 8-bit codes whose absmax lies in [2^-24, 2^40): the scale as Markstein's quotient by the
//! largest code L (its reciprocal a constant, `sdp_max_code_inverse`) and the divisor without
//! its range checks. It must give what the general path
//! (`sdp_meta_general`) gives for every absmax bit pattern of that range and its surroundings
//! (all 1.1 billion of them for 4- and 8-bit codes), and its scale must be the CPU quantizer's.

use std::path::{Path, PathBuf};
use std::process::Command;

use sdp4bit_test_support::gxx::KERNEL_HOST_FLAGS;
use sdp4bit_test_support::random::SplitMix64;

type DivideFn = unsafe extern "C" fn(*const f32, *const f32, *const f32, *mut f32, usize);
type DivideRunsFn = unsafe extern "C" fn(*const f32, f32, f32, *mut f32, usize);
type DivideUnboundedFn = unsafe extern "C" fn(*const f32, *const f32, *mut f32, usize);
type Bf16x2Fn = unsafe extern "C" fn(u32, *mut u32, usize);
type NibbleMismatchesFn = unsafe extern "C" fn() -> u64;
type MetaMismatchesFn = unsafe extern "C" fn(u32, u32, u64, u32) -> u64;
type MetaScalesFn = unsafe extern "C" fn(u32, *const u32, *mut f32, usize);
type MaxCodeInverseFn = unsafe extern "C" fn(*mut f32);

/// The helpers, loaded from the library g++ built (kept alive with it).
struct Helpers {
    _library: libloading::Library,
    divide: DivideFn,
    divide_runs: DivideRunsFn,
    divide_unbounded: DivideUnboundedFn,
    bf16x2: Bf16x2Fn,
    nibble_mismatches: NibbleMismatchesFn,
    meta_mismatches: MetaMismatchesFn,
    meta_scales: MetaScalesFn,
    max_code_inverse: MaxCodeInverseFn,
}

/// The function `name` of `lib`, as the type `F` its declaration above gives it.
///
/// # Safety
/// `F` must be the symbol's real signature (extern "C" in divide.cpp).
unsafe fn symbol<F: Copy>(lib: &libloading::Library, name: &str) -> F {
    // SAFETY: the caller vouches for the signature.
    *unsafe { lib.get::<F>(name.as_bytes()) }.unwrap_or_else(|e| panic!("{name}: {e}"))
}

/// Builds `divide.cpp` into a shared library in a fresh directory and loads it.
fn helpers() -> Helpers {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let harness = root.join("tests/kernel_emulator");
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let dir: PathBuf =
        std::env::temp_dir().join(format!("sdp4bit-divide-{}-{nanos}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("create the build directory");
    let library = dir.join("libdivide.so");
    let out = Command::new("g++")
        .args(KERNEL_HOST_FLAGS)
        .args(["-O2", "-shared", "-fPIC", "-include"])
        .arg(harness.join("cuda_shim.h"))
        .arg("-I")
        .arg(root.join("kernels"))
        .arg(harness.join("divide.cpp"))
        .arg("-o")
        .arg(&library)
        .output()
        .unwrap_or_else(|e| panic!("g++ is required to build the division helpers ({e})"));
    assert!(
        out.status.success(),
        "g++ failed on divide.cpp:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // SAFETY: the library is the one just built from divide.cpp; its initialisers do nothing
    // and the symbols have the signatures declared above (extern "C" in divide.cpp).
    let loaded = unsafe {
        let lib = libloading::Library::new(&library).expect("load the division helpers");
        let divide: DivideFn = symbol(&lib, "sdp_test_divide");
        let divide_runs: DivideRunsFn = symbol(&lib, "sdp_test_divide_runs");
        let divide_unbounded: DivideUnboundedFn = symbol(&lib, "sdp_test_divide_unbounded");
        let bf16x2: Bf16x2Fn = symbol(&lib, "sdp_test_bf16x2");
        let nibble_mismatches: NibbleMismatchesFn = symbol(&lib, "sdp_test_nibble_mismatches");
        let meta_mismatches: MetaMismatchesFn = symbol(&lib, "sdp_test_meta_mismatches");
        let meta_scales: MetaScalesFn = symbol(&lib, "sdp_test_meta_scales");
        let max_code_inverse: MaxCodeInverseFn = symbol(&lib, "sdp_test_max_code_inverse");
        Helpers {
            _library: lib,
            divide,
            divide_runs,
            divide_unbounded,
            bf16x2,
            nibble_mismatches,
            meta_mismatches,
            meta_scales,
            max_code_inverse,
        }
    };
    let _ = std::fs::remove_dir_all(&dir);
    loaded
}

/// Whether two quotients are the same fp32 value (bits equal, or both NaN).
fn same(a: f32, b: f32) -> bool {
    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
}

/// Divides every (x, s, bound) with the helper and checks each quotient against `x / s`;
/// returns how many it checked.
fn check_divide(h: &Helpers, x: &[f32], s: &[f32], bound: &[f32]) -> usize {
    let mut q = vec![0.0f32; x.len()];
    // SAFETY: four arrays of x.len() elements (s and bound as long as x, checked below).
    assert!(s.len() == x.len() && bound.len() == x.len());
    unsafe {
        (h.divide)(
            x.as_ptr(),
            s.as_ptr(),
            bound.as_ptr(),
            q.as_mut_ptr(),
            x.len(),
        )
    };
    for i in 0..x.len() {
        let want = x[i] / s[i];
        assert!(
            same(q[i], want),
            "sdp_divide_run({:e} [{:#010x}], {:e} [{:#010x}], bound {:e}) = {:e} [{:#010x}], \
             Rust's / gives {:e} [{:#010x}]",
            x[i],
            x[i].to_bits(),
            s[i],
            s[i].to_bits(),
            bound[i],
            q[i],
            q[i].to_bits(),
            want,
            want.to_bits()
        );
    }
    x.len()
}

/// Divides every run of 4 values of `x` by its divisor (`s` holds it 4 times per run) with the
/// helper without a bound on |x| and checks each quotient against `x / s`; returns how many it
/// checked.
fn check_divide_unbounded(h: &Helpers, x: &[f32], s: &[f32]) -> usize {
    assert!(s.len() == x.len() && x.len().is_multiple_of(4));
    let mut q = vec![0.0f32; x.len()];
    // SAFETY: three arrays of x.len() elements, a multiple of 4 (checked above).
    unsafe { (h.divide_unbounded)(x.as_ptr(), s.as_ptr(), q.as_mut_ptr(), x.len()) };
    for i in 0..x.len() {
        let run = &x[i / 4 * 4..i / 4 * 4 + 4];
        let want = x[i] / s[i];
        assert!(
            same(q[i], want),
            "sdp_divide_run<4, true>({:e} [{:#010x}] in the run {run:?}, {:e} [{:#010x}]) = \
             {:e} [{:#010x}], Rust's / gives {:e} [{:#010x}]",
            x[i],
            x[i].to_bits(),
            s[i],
            s[i].to_bits(),
            q[i],
            q[i].to_bits(),
            want,
            want.to_bits()
        );
    }
    x.len()
}

/// Edge values of fp32 and of the fast path's conditions, both signs.
fn edge_values() -> Vec<f32> {
    let mut bits: Vec<u32> = vec![
        0,
        1,
        2,
        0x007f_ffff,
        0x0080_0000,
        0x0080_0001,
        0x3f80_0000,
        0x3f80_0001,
        0x3fff_ffff,
        0x7f7f_ffff,
        0x7f7f_fffe,
        0x7f80_0000,
        0x7fc0_0000,
        0x42fe_0000, // 127
        0x437f_0000, // 255
        0x40e0_0000, // 7
    ];
    // The limits 2^-60, 2^60, 2^-40, 2^40 (and 2^-100, 2^100, 2^-126 + 2^-149 x k) with their
    // neighbours.
    for exponent in [
        -126i32, -101, -100, -61, -60, -41, -40, 39, 40, 59, 60, 100, 127,
    ] {
        let at = ((exponent + 127) as u32) << 23;
        bits.extend([at.wrapping_sub(1), at, at + 1, at + 0x007f_ffff]);
    }
    bits.iter()
        .flat_map(|&b| [f32::from_bits(b), -f32::from_bits(b)])
        .collect()
}

#[test]
fn divide_equals_ieee_division_on_edge_values() {
    let h = helpers();
    let edges = edge_values();
    let (mut x, mut s, mut bound) = (Vec::new(), Vec::new(), Vec::new());
    for &a in &edges {
        for &b in &edges {
            // The bound the quantizer gives (|x|), a looser one, and none (NaN).
            for limit in [a.abs(), a.abs() * 2.0, f32::INFINITY, f32::NAN] {
                x.push(a);
                s.push(b);
                bound.push(limit);
            }
        }
    }
    let checked = check_divide(&h, &x, &s, &bound);
    assert_eq!(checked, edges.len() * edges.len() * 4);
}

#[test]
fn divide_equals_ieee_division_for_every_exponent_pair() {
    let h = helpers();
    let mut rng = SplitMix64::new(0xd1_0001);
    let (mut x, mut s, mut bound) = (Vec::new(), Vec::new(), Vec::new());
    for ex in 0..=255u32 {
        for es in 0..=255u32 {
            for _ in 0..16 {
                let r = rng.next_u64();
                let sign = ((r >> 62) as u32 & 1) << 31;
                let a = f32::from_bits(sign | ex << 23 | (r as u32 & 0x007f_ffff));
                let b = f32::from_bits((es << 23) | ((r >> 23) as u32 & 0x007f_ffff));
                x.push(a);
                s.push(b);
                bound.push(a.abs());
            }
        }
    }
    check_divide(&h, &x, &s, &bound);
}

#[test]
fn divide_equals_ieee_division_for_every_mantissa_against_extreme_divisors() {
    let h = helpers();
    // Every x in [1, 2) and [-2, -1) (all 2^24 mantissas and signs) at a few exponents.
    let x: Vec<f32> = (0..1u32 << 24)
        .map(|m| f32::from_bits((m >> 23) << 31 | 0x3f80_0000 | (m & 0x007f_ffff)))
        .collect();
    let mut q = vec![0.0f32; x.len()];
    for mantissa in [0x007f_ffffu32, 0x007f_fffe, 0, 1, 0x0040_0000, 0x0055_5555] {
        for exponent in [127u32, 127 - 39, 127 + 39] {
            let s = f32::from_bits(exponent << 23 | mantissa);
            // SAFETY: x and q hold x.len() elements, a multiple of 4.
            unsafe { (h.divide_runs)(x.as_ptr(), s, 2.0, q.as_mut_ptr(), x.len()) };
            for (&a, &got) in x.iter().zip(&q) {
                assert!(
                    same(got, a / s),
                    "sdp_divide_run: {a:e} / {s:e} = {got:e}, Rust's / gives {:e}",
                    a / s
                );
            }
        }
    }
}

#[test]
fn divide_equals_ieee_division_on_random_and_quantizer_inputs() {
    let h = helpers();
    let mut rng = SplitMix64::new(0xd1_0002);
    let batch = 1usize << 20;
    let (mut x, mut s, mut bound) = (vec![0.0; batch], vec![0.0; batch], vec![0.0; batch]);
    let mut checked = 0usize;
    // Random bit patterns (every class of fp32, NaN and Inf included).
    for _ in 0..128 {
        for i in 0..batch {
            let r = rng.next_u64();
            x[i] = f32::from_bits(r as u32);
            s[i] = f32::from_bits((r >> 32) as u32);
            bound[i] = x[i].abs();
        }
        checked += check_divide(&h, &x, &s, &bound);
    }
    // The quantizer's quotients: a group's absmax (any positive finite value), its scale
    // absmax / L for a code limit L, and an element in [-absmax, absmax] (its bits below
    // absmax's, or absmax itself).
    let limits = [1.0f32, 3.0, 7.0, 15.0, 127.0, 255.0, 32767.0];
    for _ in 0..128 {
        for i in 0..batch {
            let r = rng.next_u64();
            let absmax = f32::from_bits(1 + (r as u32) % 0x7f7f_ffff);
            let scale = absmax / limits[(r >> 32) as usize % limits.len()];
            let element = match (r >> 40) & 7 {
                0 => absmax,
                _ => f32::from_bits((rng.next_u32()) % (absmax.to_bits() + 1)),
            };
            x[i] = if r >> 63 == 1 { -element } else { element };
            s[i] = scale;
            bound[i] = absmax;
        }
        checked += check_divide(&h, &x, &s, &bound);
    }
    assert_eq!(checked, 256 * batch);
}

#[test]
fn unbounded_divide_equals_ieee_division_on_edge_values() {
    let h = helpers();
    let edges = edge_values();
    let (mut x, mut s) = (Vec::new(), Vec::new());
    for &a in &edges {
        for &b in &edges {
            // The value alone in its run (four copies), and beside each edge value, so a run
            // with one value outside the fast path's range is redone whole.
            x.extend([a; 4]);
            s.extend([b; 4]);
        }
        for (i, &b) in edges.iter().enumerate() {
            x.extend([a, edges[(i + 7) % edges.len()], a, edges[i]]);
            s.extend([b; 4]);
        }
    }
    let checked = check_divide_unbounded(&h, &x, &s);
    assert_eq!(checked, edges.len() * edges.len() * 8);
}

#[test]
fn unbounded_divide_equals_ieee_division_for_every_exponent_pair() {
    let h = helpers();
    let mut rng = SplitMix64::new(0xd1_0004);
    let (mut x, mut s) = (Vec::new(), Vec::new());
    for ex in 0..=255u32 {
        for es in 0..=255u32 {
            // Four runs of 4 values of exponent ex (random mantissas and signs) by one divisor of
            // exponent es (random mantissa).
            let divisor = f32::from_bits((es << 23) | (rng.next_u32() & 0x007f_ffff));
            for _ in 0..16 {
                let r = rng.next_u32();
                x.push(f32::from_bits(
                    (r & 0x8000_0000) | ex << 23 | (r & 0x007f_ffff),
                ));
                s.push(divisor);
            }
        }
    }
    let checked = check_divide_unbounded(&h, &x, &s);
    assert_eq!(checked, 256 * 256 * 16);
}

#[test]
fn unbounded_divide_equals_ieee_division_on_random_and_global_qsgd_inputs() {
    let h = helpers();
    let mut rng = SplitMix64::new(0xd1_0005);
    let batch = 1usize << 20;
    let (mut x, mut s) = (vec![0.0; batch], vec![0.0; batch]);
    let mut checked = 0usize;
    // Random bit patterns of values and divisors (every class of fp32, NaN and Inf included).
    for _ in 0..64 {
        for run in 0..batch / 4 {
            let divisor = f32::from_bits(rng.next_u32());
            for i in 4 * run..4 * run + 4 {
                x[i] = f32::from_bits(rng.next_u32());
                s[i] = divisor;
            }
        }
        checked += check_divide_unbounded(&h, &x, &s);
    }
    // Global-QSGD's quotients: a global absmax (any positive finite value), the scale
    // absmax / K for K = 127 or 32767, and elements in [-absmax, absmax] (their bits below
    // absmax's, or absmax itself).
    for _ in 0..64 {
        for run in 0..batch / 4 {
            let r = rng.next_u64();
            let absmax = f32::from_bits(1 + (r as u32) % 0x7f7f_ffff);
            let divisor = absmax / if r >> 63 == 1 { 127.0 } else { 32767.0 };
            for i in 4 * run..4 * run + 4 {
                let e = rng.next_u64();
                let element = match e & 7 {
                    0 => absmax,
                    _ => f32::from_bits((e >> 32) as u32 % (absmax.to_bits() + 1)),
                };
                x[i] = if e >> 63 == 1 { -element } else { element };
                s[i] = divisor;
            }
        }
        checked += check_divide_unbounded(&h, &x, &s);
    }
    assert_eq!(checked, 128 * batch);
}

/// The bits of 2^e.
fn power_of_two_bits(e: i32) -> u32 {
    ((e + 127) as u32) << 23
}

#[test]
fn metadata_fast_path_equals_the_general_one_for_every_absmax() {
    let h = helpers();
    for bits in [4u32, 8] {
        // Every pattern from 2^-25 to 2^41 (the fast range [2^-24, 2^40) and a binade either
        // side), then every 997th of all absmax patterns (zero to NaN).
        let first = power_of_two_bits(-25);
        let count = u64::from(power_of_two_bits(41) - first);
        // SAFETY: plain values in, a count out.
        let dense = unsafe { (h.meta_mismatches)(bits, first, count, 1) };
        assert_eq!(
            dense, 0,
            "{bits}-bit codes: {dense} absmax patterns in [2^-25, 2^41) differ"
        );
        // SAFETY: as above.
        let sparse = unsafe { (h.meta_mismatches)(bits, 0, 1 << 31, 997) };
        assert_eq!(
            sparse, 0,
            "{bits}-bit codes: {sparse} sampled absmax patterns differ"
        );
    }
}

#[test]
fn metadata_scale_is_the_cpu_quantizers() {
    use sdp4bit::Rounding;
    use sdp4bit::codec::quant::{QuantSpec, quantize_group};
    let h = helpers();
    let mut rng = SplitMix64::new(0xd1_0003);
    // Both ends of the fast range and of fp32 with their neighbours, then random patterns of
    // every finite absmax.
    let mut abs_bits: Vec<u32> = [-25, -24, -23, 39, 40, 41]
        .iter()
        .flat_map(|&e| {
            let at = power_of_two_bits(e);
            [at - 2, at - 1, at, at + 1, at + 2]
        })
        .chain([
            0,
            1,
            0x007f_ffff,
            0x0080_0000,
            0x7f7f_ffff,
            0x7f80_0000,
            0x7fc0_0000,
        ])
        .collect();
    abs_bits.extend((0..1 << 20).map(|_| rng.next_u32() % 0x7f80_0000));
    for bits in [4u8, 8] {
        let spec = QuantSpec {
            bits,
            group_size: 32,
            symmetric: true,
            rounding: Rounding::Nearest,
        };
        let mut scale = vec![0.0f32; abs_bits.len()];
        // SAFETY: abs_bits and scale hold abs_bits.len() elements.
        unsafe {
            (h.meta_scales)(
                u32::from(bits),
                abs_bits.as_ptr(),
                scale.as_mut_ptr(),
                abs_bits.len(),
            )
        };
        let mut x = vec![0.0f32; 32];
        let mut codes = vec![0u8; spec.code_bytes_per_group()];
        for (&a, &got) in abs_bits.iter().zip(&scale) {
            x[0] = f32::from_bits(a);
            let want = quantize_group(&spec, &x, &[0.0; 32], &mut codes).scale;
            assert!(
                same(got, want),
                "{bits}-bit codes, absmax {:e} [{a:#010x}]: scale {got:e}, the CPU's {want:e}",
                f32::from_bits(a)
            );
        }
    }
}

#[test]
fn max_code_inverse_is_the_correctly_rounded_reciprocal() {
    let h = helpers();
    let mut inverse = [0.0f32; 2];
    // SAFETY: inverse holds the two values written.
    unsafe { (h.max_code_inverse)(inverse.as_mut_ptr()) };
    // The largest codes of symmetric 4- and 8-bit quantizers.
    for (l, got) in [7, 127].into_iter().zip(inverse) {
        let want = 1.0 / l as f32;
        assert!(same(got, want), "L = {l}: {got:e}, want {want:e}");
    }
}

#[test]
fn packed_bf16_rounding_is_the_cpu_rounding_for_every_pattern() {
    let h = helpers();
    // Every fp32 bit pattern (NaNs, Inf, subnormals, signed zeros and each rounding tie
    // included), in pairs of neighbours, against the CPU reference's rounding (the `half`
    // crate's, bit for bit: a NaN keeps its high payload and comes out quiet).
    let chunk = 1usize << 26;
    let mut words = vec![0u32; chunk / 2];
    for first in (0..1u64 << 32).step_by(chunk) {
        // SAFETY: words holds chunk / 2 elements.
        unsafe { (h.bf16x2)(first as u32, words.as_mut_ptr(), words.len()) };
        for (i, &word) in words.iter().enumerate() {
            for (half_index, got) in [(0u32, word as u16), (1, (word >> 16) as u16)] {
                let bits = first as u32 + 2 * i as u32 + half_index;
                let want = half::bf16::from_f32(f32::from_bits(bits)).to_bits();
                assert_eq!(
                    got, want,
                    "sdp_f32x2_to_bf16x2 of [{bits:#010x}]: {got:#06x}, the CPU's {want:#06x}"
                );
            }
        }
    }
}

#[test]
fn nibble_decoding_in_place_equals_the_shifted_conversion() {
    let h = helpers();
    // SAFETY: no arguments, a count out.
    let mismatches = unsafe { (h.nibble_mismatches)() };
    assert_eq!(mismatches, 0, "{mismatches} nibbles decode differently");
}

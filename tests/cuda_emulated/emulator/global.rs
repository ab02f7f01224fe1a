//! The Global-QSGD family: the absmax, the rounding to int8 / int16 (stochastic and nearest)
//! and the dequantization of summed integers; its cases and its test.

use half::bf16;
use sdp4bit::Rounding;
use sdp4bit::backend::GradElement;
use sdp4bit::backend::cpu::global_qsgd;
use sdp4bit::backend::cuda::abi::SdpGlobal;
use sdp4bit::backend::cuda::source::Kernel;
use sdp4bit::codec::int_code::IntCode;
use sdp4bit::codec::sum::SumElement;
use sdp4bit::collective::{global_k, sum_in_rank_order};
use sdp4bit::rng::Stage;

use super::case::{Buf, Case, Expect};
use super::data::{bf16_bytes, f32_bytes, garbage, stream, values};
use super::sweep::{Coverage, emulate_family};
use sdp4bit_test_support::random::SplitMix64;

/// The data of one Global-QSGD case.
#[derive(Debug, Clone, Copy)]
pub(super) enum GlobalData {
    /// Finite values, including denormals, zeros and values near `f32::MAX`.
    Plain,
    /// With NaN and Inf (the absmax flags them; the rounding still runs at some scale).
    Specials,
    /// All zeros: the scale is 0, so every `x / s` is NaN.
    Zeros,
}

/// Integer codes Global-QSGD sums, with their kernels.
trait WireInt: IntCode + Default + SumElement + Into<i64> + TryFrom<i64> {
    const QUANTIZE: Kernel;
    const DEQUANTIZE: Kernel;
    const QUANTIZE_BF16: Kernel;
    const DEQUANTIZE_BF16: Kernel;
    /// The largest value (the smallest is `-MAX - 1`).
    const MAX: i64;
    fn random(rand: &mut SplitMix64) -> Self;
    fn le_bytes(values: &[Self]) -> Vec<u8>;
}

impl WireInt for i8 {
    const QUANTIZE: Kernel = Kernel::GlobalQuantizeI8;
    const DEQUANTIZE: Kernel = Kernel::GlobalDequantizeI8;
    const QUANTIZE_BF16: Kernel = Kernel::GlobalQuantizeI8Bf16;
    const DEQUANTIZE_BF16: Kernel = Kernel::GlobalDequantizeI8Bf16;
    const MAX: i64 = i8::MAX as i64;
    fn random(rand: &mut SplitMix64) -> Self {
        rand.next_u64() as i8
    }
    fn le_bytes(values: &[Self]) -> Vec<u8> {
        values.iter().map(|&v| v as u8).collect()
    }
}

impl WireInt for i16 {
    const QUANTIZE: Kernel = Kernel::GlobalQuantizeI16;
    const DEQUANTIZE: Kernel = Kernel::GlobalDequantizeI16;
    const QUANTIZE_BF16: Kernel = Kernel::GlobalQuantizeI16Bf16;
    const DEQUANTIZE_BF16: Kernel = Kernel::GlobalDequantizeI16Bf16;
    const MAX: i64 = i16::MAX as i64;
    fn random(rand: &mut SplitMix64) -> Self {
        rand.next_u64() as i16
    }
    fn le_bytes(values: &[Self]) -> Vec<u8> {
        values.iter().flat_map(|v| v.to_le_bytes()).collect()
    }
}

/// Global-QSGD over one bucket: the absmax, then for int8 and int16 at two world sizes the
/// rounding (stochastic and nearest) at the scale the collective would use, and the
/// dequantization of random sums.
pub(super) fn global_case(rand: &mut SplitMix64, numel: usize, data: GlobalData) -> Case {
    let mut case = Case::new(format!("global-qsgd n={numel} {data:?}"), rand);
    let mut bucket = values(rand, numel, 64);
    match data {
        GlobalData::Plain => bucket
            .iter_mut()
            .filter(|x| !x.is_finite())
            .for_each(|x| *x = 0.5),
        GlobalData::Specials => {}
        GlobalData::Zeros => bucket.fill(0.0),
    }
    let absmax = global_qsgd::local_absmax(&bucket);
    let input = case.input(f32_bytes(&bucket));
    let bits = case.output(
        vec![0; 4],
        "global_absmax".into(),
        Expect::AbsmaxBits,
        absmax.to_bits().to_le_bytes().to_vec(),
    );
    case.launch(
        Kernel::GlobalAbsmax,
        numel as u64,
        &[Some(input), Some(bits)],
        &SdpGlobal::absmax(numel),
    );
    global_codes::<i8, f32>(&mut case, rand, input, &bucket, absmax, 2);
    global_codes::<i8, f32>(&mut case, rand, input, &bucket, absmax, 127);
    global_codes::<i16, f32>(&mut case, rand, input, &bucket, absmax, 3);
    global_codes::<i16, f32>(&mut case, rand, input, &bucket, absmax, 1000);

    // The bf16 variants over the bucket rounded to bf16, into bf16 shards.
    let bucket: Vec<bf16> = bucket.iter().map(|&x| bf16::from_f32(x)).collect();
    let absmax = global_qsgd::local_absmax(&bucket);
    let input = case.input(bf16_bytes(&bucket));
    let bits = case.output(
        vec![0; 4],
        "global_absmax_bf16".into(),
        Expect::AbsmaxBits,
        absmax.to_bits().to_le_bytes().to_vec(),
    );
    case.launch(
        Kernel::GlobalAbsmaxBf16,
        numel as u64,
        &[Some(input), Some(bits)],
        &SdpGlobal::absmax(numel),
    );
    global_codes::<i8, bf16>(&mut case, rand, input, &bucket, absmax, 5);
    global_codes::<i16, bf16>(&mut case, rand, input, &bucket, absmax, 300);
    case
}

/// The bytes of gradient elements and how an output of them is compared.
fn grad_output<G: GradElement>(values: &[G]) -> (Vec<u8>, Expect) {
    let expect = if G::IS_BF16 {
        Expect::Bf16
    } else {
        Expect::F32
    };
    (bytemuck::cast_slice(values).to_vec(), expect)
}

/// The quantize and dequantize kernel of `T` codes and `G` gradients.
fn kernels_of<T: WireInt, G: GradElement>() -> (Kernel, Kernel) {
    if G::IS_BF16 {
        (T::QUANTIZE_BF16, T::DEQUANTIZE_BF16)
    } else {
        (T::QUANTIZE, T::DEQUANTIZE)
    }
}

/// The rounding (stochastic and nearest) of `bucket` to `T` at the scale the collective uses
/// for `w` ranks, and the dequantization of random sums.
fn global_codes<T: WireInt, G: GradElement>(
    case: &mut Case,
    rand: &mut SplitMix64,
    input: Buf,
    bucket: &[G],
    absmax: f32,
    w: usize,
) {
    let numel = bucket.len();
    let k = global_k(T::BITS, w);
    // A non-finite absmax never reaches the rounding in the collective; any scale still
    // exercises NaN / Inf inputs here.
    let scale = if absmax.is_finite() {
        absmax / k as f32
    } else {
        0.37
    };
    let width = size_of::<T>();
    let (quantize, dequantize) = kernels_of::<T, G>();
    for rounding in [Rounding::Stochastic, Rounding::Nearest] {
        let rng = stream(rand, 0, Stage::GlobalQsgd);
        let mut want = vec![T::default(); numel];
        global_qsgd::quantize(bucket, scale, k, rounding, &rng, &mut want);
        let out = case.output(
            garbage(numel * width),
            format!("{} W={w} {rounding:?}", quantize.name()),
            Expect::Ints(width),
            T::le_bytes(&want),
        );
        case.launch(
            quantize,
            numel as u64,
            &[Some(input), Some(out)],
            &SdpGlobal::quantize(numel, scale, k, rounding, &rng),
        );
    }
    let sums: Vec<T> = (0..numel).map(|_| T::random(rand)).collect();
    let mut want = vec![G::from_f32(0.0); numel];
    global_qsgd::dequantize(&sums, scale, &mut want);
    let sums = case.input(T::le_bytes(&sums));
    let (want, expect) = grad_output(&want);
    let out = case.output(
        garbage(want.len()),
        format!("{} W={w}", dequantize.name()),
        expect,
        want,
    );
    case.launch(
        dequantize,
        numel as u64,
        &[Some(sums), Some(out)],
        &SdpGlobal::dequantize(numel, scale),
    );
    // Whole aligned runs take the device's main loop when numel is a multiple of 4 (a padded
    // shard); otherwise every run is summed element by element.
    for (blocks, numel) in [
        (2, numel),
        (8, numel.next_multiple_of(4)),
        (5, numel.next_multiple_of(4)),
    ] {
        global_sums::<T, G>(case, rand, numel, blocks, scale);
    }
}

/// The dequantization of `blocks` rank blocks of `numel` integers summed in rank order on the
/// device: a third of the elements draw their integers from the whole range of `T`, so many
/// partial sums overflow (some sums come back into range afterwards), the others stay small
/// enough never to. Every element with a partial sum outside `T` must be NaN, the others the
/// host's scaled sum, and the status word must name the first overflow in rank order, the one
/// `sum_in_rank_order` reports.
fn global_sums<T: WireInt, G: GradElement>(
    case: &mut Case,
    rand: &mut SplitMix64,
    numel: usize,
    blocks: usize,
    scale: f32,
) {
    let small = T::MAX as usize / blocks;
    let wide: Vec<bool> = (0..numel).map(|_| rand.below(3) == 0).collect();
    let ranks: Vec<Vec<T>> = (0..blocks)
        .map(|_| {
            wide.iter()
                .map(|&wide| {
                    if wide {
                        T::random(rand)
                    } else {
                        let v = rand.below(2 * small + 1) as i64 - small as i64;
                        T::try_from(v).ok().expect("a small value fits")
                    }
                })
                .collect()
        })
        .collect();
    // Each element's sum in rank order and the first block whose partial sum leaves T.
    let (lowest, highest) = (-T::MAX - 1, T::MAX);
    let mut sums = vec![T::default(); numel];
    let mut first_overflow = vec![None; numel];
    for i in 0..numel {
        let mut acc: i64 = ranks[0][i].into();
        for (r, rank) in ranks.iter().enumerate().skip(1) {
            acc += rank[i].into();
            if first_overflow[i].is_none() && !(lowest..=highest).contains(&acc) {
                first_overflow[i] = Some(r);
            }
        }
        if first_overflow[i].is_none() {
            sums[i] = T::try_from(acc).ok().expect("a sum inside T");
        }
    }
    let mut want = vec![G::from_f32(0.0); numel];
    global_qsgd::dequantize(&sums, scale, &mut want);
    for (w, first) in want.iter_mut().zip(&first_overflow) {
        if first.is_some() {
            *w = G::from_f32(f32::NAN);
        }
    }
    let first = (0..numel)
        .filter_map(|i| first_overflow[i].map(|r| (r, i)))
        .min();
    // The host's sum in rank order stops at the same first overflow, or agrees on every sum.
    let bytes: Vec<Vec<u8>> = ranks.iter().map(|r| T::le_bytes(r)).collect();
    let mut host = vec![T::default(); numel];
    match (
        sum_in_rank_order(bytes.iter().map(Vec::as_slice), &mut host, 0),
        first,
    ) {
        (Ok(()), None) => assert!(host == sums, "host sums differ from the reference's"),
        (Err(e), Some((_, i))) => assert!(
            e.to_string().contains(&format!("at element {i} of")),
            "host: {e}, reference: first overflow at element {i}"
        ),
        (host, reference) => panic!("host: {host:?}, reference: first overflow {reference:?}"),
    }
    let status = first.map_or(0, |(r, i)| u32::MAX - (r * numel + i) as u32);
    let sums = case.input(bytes.concat());
    let dequantize = kernels_of::<T, G>().1;
    let name = dequantize.name();
    let (want, expect) = grad_output(&want);
    let out = case.output(
        garbage(want.len()),
        format!("{name} of {blocks} blocks"),
        expect,
        want,
    );
    let word = case.output(
        vec![0; 4],
        format!("{name} of {blocks} blocks: status word"),
        Expect::OverflowStatus(numel),
        status.to_le_bytes().to_vec(),
    );
    case.launch(
        dequantize,
        numel as u64,
        &[Some(sums), Some(out)],
        &SdpGlobal {
            scale,
            ..SdpGlobal::sum_and_dequantize(numel, blocks as u32, 0)
        },
    );
    case.address_in_params(std::mem::offset_of!(SdpGlobal, status), word);
}

/// The parameter struct of Global-QSGD's kernels.
pub(super) const GLOBAL: &[&str] = &["sdp_global"];

/// Global-QSGD over buckets of eight sizes ([`Coverage::Full`]) or four, with plain data and
/// with NaN / Inf, and one all-zero bucket.
fn global_cases(rand: &mut SplitMix64, coverage: Coverage) -> Vec<Case> {
    let sizes: &[usize] = match coverage {
        Coverage::Full => &[1, 5, 255, 1000, 4097, 10_007, 70_001, 100_003],
        Coverage::Subset => &[1, 255, 4097, 10_007],
    };
    let mut cases = Vec::new();
    for &numel in sizes {
        for data in [GlobalData::Plain, GlobalData::Specials] {
            cases.push(global_case(rand, numel, data));
        }
    }
    cases.push(global_case(rand, 777, GlobalData::Zeros));
    cases
}

#[test]
fn global_qsgd() {
    emulate_family("Global-QSGD", GLOBAL, global_cases);
}

//! The emulator cases of Global-QSGD's kernels: the absmax, the rounding to int8 / int16
//! (stochastic and nearest) and the dequantization of summed integers.

use sdp4bit::Rounding;
use sdp4bit::backend::cpu::global_qsgd;
use sdp4bit::backend::cuda::abi::SdpGlobal;
use sdp4bit::backend::cuda::source::Kernel;
use sdp4bit::codec::int_code::IntCode;
use sdp4bit::collective::global_k;
use sdp4bit::rng::Stage;

use super::case::{Buf, Case, ELEMENTS_PER_BLOCK, Expect};
use super::data::{f32_bytes, garbage, stream, values};
use sdp4bit_test_support::random::SplitMix64;

/// The data of one Global-QSGD case.
#[derive(Debug, Clone, Copy)]
pub enum GlobalData {
    /// Finite values, including denormals, zeros and values near `f32::MAX`.
    Plain,
    /// With NaN and Inf (the absmax flags them; the rounding still runs at some scale).
    Specials,
    /// All zeros: the scale is 0, so every `x / s` is NaN.
    Zeros,
}

/// Integer codes Global-QSGD sums, with their kernels.
trait WireInt: IntCode + Default {
    const QUANTIZE: Kernel;
    const DEQUANTIZE: Kernel;
    fn random(rand: &mut SplitMix64) -> Self;
    fn le_bytes(values: &[Self]) -> Vec<u8>;
}

impl WireInt for i8 {
    const QUANTIZE: Kernel = Kernel::GlobalQuantizeI8;
    const DEQUANTIZE: Kernel = Kernel::GlobalDequantizeI8;
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
pub fn global_case(rand: &mut SplitMix64, numel: usize, data: GlobalData) -> Case {
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
        ELEMENTS_PER_BLOCK,
        &[Some(input), Some(bits)],
        &SdpGlobal::absmax(numel),
    );
    global_codes::<i8>(&mut case, rand, input, &bucket, absmax, 2);
    global_codes::<i8>(&mut case, rand, input, &bucket, absmax, 127);
    global_codes::<i16>(&mut case, rand, input, &bucket, absmax, 3);
    global_codes::<i16>(&mut case, rand, input, &bucket, absmax, 1000);
    case
}

/// The rounding (stochastic and nearest) of `bucket` to `T` at the scale the collective uses
/// for `w` ranks, and the dequantization of random sums.
fn global_codes<T: WireInt>(
    case: &mut Case,
    rand: &mut SplitMix64,
    input: Buf,
    bucket: &[f32],
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
    for rounding in [Rounding::Stochastic, Rounding::Nearest] {
        let rng = stream(rand, 0, Stage::GlobalQsgd);
        let mut want = vec![T::default(); numel];
        global_qsgd::quantize(bucket, scale, k, rounding, &rng, &mut want);
        let out = case.output(
            garbage(numel * width),
            format!("{} W={w} {rounding:?}", T::QUANTIZE.name()),
            Expect::Ints(width),
            T::le_bytes(&want),
        );
        case.launch(
            T::QUANTIZE,
            numel as u64,
            ELEMENTS_PER_BLOCK,
            &[Some(input), Some(out)],
            &SdpGlobal::quantize(numel, scale, k, rounding, &rng),
        );
    }
    let sums: Vec<T> = (0..numel).map(|_| T::random(rand)).collect();
    let mut want = vec![0f32; numel];
    global_qsgd::dequantize(&sums, scale, &mut want);
    let sums = case.input(T::le_bytes(&sums));
    let out = case.output(
        garbage(4 * numel),
        format!("{} W={w}", T::DEQUANTIZE.name()),
        Expect::F32,
        f32_bytes(&want),
    );
    case.launch(
        T::DEQUANTIZE,
        numel as u64,
        ELEMENTS_PER_BLOCK,
        &[Some(sums), Some(out)],
        &SdpGlobal::dequantize(numel, scale),
    );
}

//! The CUDA C++ sources of the kernels, embedded in the library at build time.
//!
//! One [`KernelSource`] per file of `kernels/` (one fused operation each), with the kernels it
//! defines; the two shared headers are handed to NVRTC in memory ([`HEADERS`]).

/// Every kernel of the launch ABI (`kernels/sdp4bit_abi.h`); the discriminant indexes the
/// per-device function table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kernel {
    /// Hadamard + quantize + swizzle of a gradient bucket (`sdp_grad_first`).
    GradQuantizeFirst,
    /// Dequantize + sum + requantize between the two gradient levels (`sdp_grad_second`).
    GradRequantizeSecond,
    /// Dequantize + sum + inverse Hadamard into the shard (`sdp_grad_final`).
    GradReduceFinal,
    /// Quantize a weight shard or its difference (`sdp_weight_encode`).
    WeightEncode,
    /// Apply every rank's weight slab to the param bucket (`sdp_weight_apply`).
    WeightApply,
    /// Global-QSGD: absmax bits of a bucket (`sdp_global`).
    GlobalAbsmax,
    /// Global-QSGD: round to int8 (`sdp_global`).
    GlobalQuantizeI8,
    /// Global-QSGD: round to int16 (`sdp_global`).
    GlobalQuantizeI16,
    /// Global-QSGD: dequantize summed int8 (`sdp_global`).
    GlobalDequantizeI8,
    /// Global-QSGD: dequantize summed int16 (`sdp_global`).
    GlobalDequantizeI16,
    /// [`GradQuantizeFirst`](Self::GradQuantizeFirst) of a bf16 bucket.
    GradQuantizeFirstBf16,
    /// [`GradReduceFinal`](Self::GradReduceFinal) into a bf16 shard.
    GradReduceFinalBf16,
    /// [`GlobalAbsmax`](Self::GlobalAbsmax) of a bf16 bucket.
    GlobalAbsmaxBf16,
    /// [`GlobalQuantizeI8`](Self::GlobalQuantizeI8) of a bf16 bucket.
    GlobalQuantizeI8Bf16,
    /// [`GlobalQuantizeI16`](Self::GlobalQuantizeI16) of a bf16 bucket.
    GlobalQuantizeI16Bf16,
    /// [`GlobalDequantizeI8`](Self::GlobalDequantizeI8) into a bf16 shard.
    GlobalDequantizeI8Bf16,
    /// [`GlobalDequantizeI16`](Self::GlobalDequantizeI16) into a bf16 shard.
    GlobalDequantizeI16Bf16,
    /// bf16 gradients to fp32 (`sdp_convert`).
    GradWidenBf16,
    /// fp32 gradients rounded to bf16 (`sdp_convert`).
    GradNarrowBf16,
    /// bf16 gradients through fp32 back to bf16 (`sdp_convert`).
    GradRoundBf16,
}

impl Kernel {
    /// Number of kernels.
    pub const COUNT: usize = 20;

    /// Every kernel, in discriminant order.
    pub const ALL: [Kernel; Self::COUNT] = [
        Kernel::GradQuantizeFirst,
        Kernel::GradRequantizeSecond,
        Kernel::GradReduceFinal,
        Kernel::WeightEncode,
        Kernel::WeightApply,
        Kernel::GlobalAbsmax,
        Kernel::GlobalQuantizeI8,
        Kernel::GlobalQuantizeI16,
        Kernel::GlobalDequantizeI8,
        Kernel::GlobalDequantizeI16,
        Kernel::GradQuantizeFirstBf16,
        Kernel::GradReduceFinalBf16,
        Kernel::GlobalAbsmaxBf16,
        Kernel::GlobalQuantizeI8Bf16,
        Kernel::GlobalQuantizeI16Bf16,
        Kernel::GlobalDequantizeI8Bf16,
        Kernel::GlobalDequantizeI16Bf16,
        Kernel::GradWidenBf16,
        Kernel::GradNarrowBf16,
        Kernel::GradRoundBf16,
    ];

    /// The `extern "C"` name of the kernel (its `.entry` in the PTX).
    pub fn name(self) -> &'static str {
        match self {
            Kernel::GradQuantizeFirst => "grad_quantize_first",
            Kernel::GradRequantizeSecond => "grad_requantize_second",
            Kernel::GradReduceFinal => "grad_reduce_final",
            Kernel::WeightEncode => "weight_encode",
            Kernel::WeightApply => "weight_apply",
            Kernel::GlobalAbsmax => "global_absmax",
            Kernel::GlobalQuantizeI8 => "global_quantize_i8",
            Kernel::GlobalQuantizeI16 => "global_quantize_i16",
            Kernel::GlobalDequantizeI8 => "global_dequantize_i8",
            Kernel::GlobalDequantizeI16 => "global_dequantize_i16",
            Kernel::GradQuantizeFirstBf16 => "grad_quantize_first_bf16",
            Kernel::GradReduceFinalBf16 => "grad_reduce_final_bf16",
            Kernel::GlobalAbsmaxBf16 => "global_absmax_bf16",
            Kernel::GlobalQuantizeI8Bf16 => "global_quantize_i8_bf16",
            Kernel::GlobalQuantizeI16Bf16 => "global_quantize_i16_bf16",
            Kernel::GlobalDequantizeI8Bf16 => "global_dequantize_i8_bf16",
            Kernel::GlobalDequantizeI16Bf16 => "global_dequantize_i16_bf16",
            Kernel::GradWidenBf16 => "grad_widen_bf16",
            Kernel::GradNarrowBf16 => "grad_narrow_bf16",
            Kernel::GradRoundBf16 => "grad_round_bf16",
        }
    }
}

/// One `.cu` file of `kernels/`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KernelSource {
    /// File name inside `kernels/` (also the NVRTC program name, so logs name the file).
    pub file: &'static str,
    /// The CUDA C++ source.
    pub code: &'static str,
    /// The kernels the file defines.
    pub kernels: &'static [Kernel],
}

/// The headers the sources include, as `(include name, contents)`.
pub const HEADERS: [(&str, &str); 2] = [
    (
        "sdp4bit_abi.h",
        include_str!("../../../kernels/sdp4bit_abi.h"),
    ),
    ("common.cuh", include_str!("../../../kernels/common.cuh")),
];

/// Every kernel source; each [`Kernel`] is defined by exactly one of them.
pub const SOURCES: [KernelSource; 7] = [
    KernelSource {
        file: "grad_quantize_first.cu",
        code: include_str!("../../../kernels/grad_quantize_first.cu"),
        kernels: &[Kernel::GradQuantizeFirst, Kernel::GradQuantizeFirstBf16],
    },
    KernelSource {
        file: "grad_requantize_second.cu",
        code: include_str!("../../../kernels/grad_requantize_second.cu"),
        kernels: &[Kernel::GradRequantizeSecond],
    },
    KernelSource {
        file: "grad_reduce_final.cu",
        code: include_str!("../../../kernels/grad_reduce_final.cu"),
        kernels: &[Kernel::GradReduceFinal, Kernel::GradReduceFinalBf16],
    },
    KernelSource {
        file: "weight_encode.cu",
        code: include_str!("../../../kernels/weight_encode.cu"),
        kernels: &[Kernel::WeightEncode],
    },
    KernelSource {
        file: "weight_apply.cu",
        code: include_str!("../../../kernels/weight_apply.cu"),
        kernels: &[Kernel::WeightApply],
    },
    KernelSource {
        file: "global_qsgd.cu",
        code: include_str!("../../../kernels/global_qsgd.cu"),
        kernels: &[
            Kernel::GlobalAbsmax,
            Kernel::GlobalQuantizeI8,
            Kernel::GlobalQuantizeI16,
            Kernel::GlobalDequantizeI8,
            Kernel::GlobalDequantizeI16,
            Kernel::GlobalAbsmaxBf16,
            Kernel::GlobalQuantizeI8Bf16,
            Kernel::GlobalQuantizeI16Bf16,
            Kernel::GlobalDequantizeI8Bf16,
            Kernel::GlobalDequantizeI16Bf16,
        ],
    },
    KernelSource {
        file: "grad_convert.cu",
        code: include_str!("../../../kernels/grad_convert.cu"),
        kernels: &[
            Kernel::GradWidenBf16,
            Kernel::GradNarrowBf16,
            Kernel::GradRoundBf16,
        ],
    },
];

#[cfg(test)]
mod tests {
    use super::*;

    /// Every kernel is defined by exactly one source, and `ALL` is in discriminant order.
    #[test]
    fn every_kernel_has_one_source() {
        for (i, kernel) in Kernel::ALL.into_iter().enumerate() {
            assert_eq!(kernel as usize, i, "{kernel:?}");
            let defining = SOURCES
                .iter()
                .filter(|s| s.kernels.contains(&kernel))
                .count();
            assert_eq!(defining, 1, "{kernel:?} is defined by {defining} sources");
        }
    }
}

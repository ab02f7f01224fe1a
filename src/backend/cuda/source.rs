//! The CUDA C++ sources of the kernels, embedded in the library at build time, and the kernel
//! table.
//!
//! build.rs generates [`Kernel`], [`SOURCES`] and [`HEADERS`] from `kernels/`: one [`Kernel`]
//! per line of the kernel table `kernels/sdp4bit_kernels.h`, one [`KernelSource`] per `.cu`
//! file (one fused operation each) with the kernels it defines, and the headers, which are
//! handed to NVRTC in memory.

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

/// A pointer parameter of a kernel, as its line of the kernel table declares it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pointer {
    /// The parameter's name.
    pub name: &'static str,
    /// The C type it points to, with its `const` (read only) when it has one.
    pub element: &'static str,
    /// Bytes of one element.
    pub element_bytes: usize,
}

include!(concat!(env!("OUT_DIR"), "/kernels.rs"));

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

//! Which image the kernels are compiled to for a device: a CUBIN for the device's own
//! architecture when the loaded NVRTC can target it, PTX otherwise.
//!
//! A CUBIN is machine code: the driver loads it without compiling, so it does not depend on
//! the driver understanding the PTX ISA version of the NVRTC that made it (a driver rejects
//! PTX whose `.version` is newer than it knows, `CUDA_ERROR_UNSUPPORTED_PTX_VERSION`). PTX is
//! the fallback for a device newer than every architecture the NVRTC knows: PTX for the
//! newest virtual architecture at or below the device's, which the driver compiles for the
//! device when the module loads.

use std::ffi::c_int;

use cudarc::nvrtc::sys;

use super::compile::{Arch, Target};
use super::probe;
use crate::error::{Error, Result};

/// The image chosen for a device, and why (for telemetry and error messages).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TargetChoice {
    /// What to compile for.
    pub target: Target,
    /// Why: the device's architecture and what the NVRTC can target.
    pub reason: String,
}

/// The real architectures the loaded NVRTC can compile for (`nvrtcGetSupportedArchs`),
/// ascending.
pub fn supported_archs() -> Result<Vec<Arch>> {
    probe::nvrtc()?;
    let mut count: c_int = 0;
    // SAFETY: `count` receives one int.
    unsafe { sys::nvrtcGetNumSupportedArchs(&mut count) }
        .result()
        .map_err(|e| Error::Cuda(format!("nvrtcGetNumSupportedArchs failed: {e}")))?;
    let mut values: Vec<c_int> = vec![0; usize::try_from(count).unwrap_or(0)];
    if !values.is_empty() {
        // SAFETY: `values` holds the `count` ints NVRTC reported.
        unsafe { sys::nvrtcGetSupportedArchs(values.as_mut_ptr()) }
            .result()
            .map_err(|e| Error::Cuda(format!("nvrtcGetSupportedArchs failed: {e}")))?;
    }
    let mut archs: Vec<Arch> = values
        .into_iter()
        .filter_map(|v| u32::try_from(v).ok())
        .map(|v| Arch {
            major: v / 10,
            minor: v % 10,
        })
        .collect();
    archs.sort_by_key(|a| (a.major, a.minor));
    Ok(archs)
}

/// The image for a device of architecture `device` given the architectures the NVRTC
/// (version `nvrtc`) supports: a CUBIN for `device` when it is among them, else PTX for the
/// newest one below it; an error when every supported architecture is newer than the device.
pub fn choose(device: Arch, supported: &[Arch], nvrtc: (u32, u32)) -> Result<TargetChoice> {
    let listed = supported
        .iter()
        .map(Arch::to_string)
        .collect::<Vec<_>>()
        .join(", ");
    let (major, minor) = nvrtc;
    if supported.contains(&device) {
        return Ok(TargetChoice {
            target: Target::Cubin(device),
            reason: format!("NVRTC {major}.{minor} targets the device's {device}"),
        });
    }
    let key = |a: &Arch| (a.major, a.minor);
    match supported
        .iter()
        .filter(|a| key(a) < key(&device))
        .max_by_key(|a| key(a))
    {
        Some(&below) => Ok(TargetChoice {
            target: Target::Ptx(below),
            reason: format!(
                "NVRTC {major}.{minor} cannot target the device's {device} (it targets \
                 {listed}); the driver compiles PTX for compute_{}{} at load time",
                below.major, below.minor
            ),
        }),
        None => Err(Error::Cuda(format!(
            "NVRTC {major}.{minor} cannot compile for the device's {device}: it targets only \
             {listed}, all newer than the device"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SUPPORTED: [Arch; 3] = [
        Arch { major: 7, minor: 5 },
        Arch::SM_90,
        Arch {
            major: 12,
            minor: 0,
        },
    ];

    /// A supported device gets a CUBIN for its own architecture.
    #[test]
    fn supported_device_gets_a_cubin() {
        let choice = choose(Arch::SM_90, &SUPPORTED, (13, 0)).expect("supported");
        assert_eq!(choice.target, Target::Cubin(Arch::SM_90));
        assert!(choice.reason.contains("sm_90"), "{}", choice.reason);
    }

    /// A device between or above the supported architectures gets PTX of the newest one
    /// below it, and the reason lists what the NVRTC targets.
    #[test]
    fn unsupported_newer_device_gets_ptx_below_it() {
        let sm_89 = Arch { major: 8, minor: 9 };
        let choice = choose(sm_89, &SUPPORTED, (13, 0)).expect("PTX");
        assert_eq!(choice.target, Target::Ptx(Arch { major: 7, minor: 5 }));
        let sm_130 = Arch {
            major: 13,
            minor: 0,
        };
        let choice = choose(sm_130, &SUPPORTED, (13, 0)).expect("PTX");
        assert_eq!(
            choice.target,
            Target::Ptx(Arch {
                major: 12,
                minor: 0
            })
        );
        assert!(
            choice.reason.contains("sm_75, sm_90, sm_120"),
            "{}",
            choice.reason
        );
    }

    /// A device older than everything the NVRTC targets is an error naming both.
    #[test]
    fn older_device_is_an_error() {
        let sm_70 = Arch { major: 7, minor: 0 };
        let e = choose(sm_70, &SUPPORTED, (13, 0)).expect_err("too old");
        assert!(e.to_string().contains("sm_70"), "{e}");
        assert!(e.to_string().contains("sm_75"), "{e}");
    }
}

//! Which image the kernels are compiled to for a device: a CUBIN for the device's own
//! architecture when the loaded NVRTC can target it, PTX otherwise.
//!
//! A CUBIN is machine code: the driver loads it without compiling, so it does not depend on
//! the driver understanding the PTX ISA version of the NVRTC that made it (a driver rejects
//! PTX whose `.version` is newer than it knows, `CUDA_ERROR_UNSUPPORTED_PTX_VERSION`). PTX is
//! the fallback for a device newer than every architecture the NVRTC knows: PTX for the
//! newest virtual architecture at or below the device's, which the driver compiles for the
//! device when the module loads.
//!
//! Either image must come from an NVRTC the driver is promised to load: a CUBIN from an NVRTC
//! of the driver's major CUDA version or older, PTX from one no newer than the driver (which
//! must know the PTX's ISA version). [`check_driver`] refuses any other pairing, naming both
//! versions, rather than leaving the driver to fail or not.

use std::ffi::c_int;

use cudarc::nvrtc::sys;

use super::compile::{Arch, Target};
use super::probe::{self, NVRTC_LIBRARY_VAR, NvrtcLibrary};
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

/// Refuses `target` made by `nvrtc` when the driver (`cuDriverGetVersion`'s `driver`, 1000 *
/// major + 10 * minor) is not promised to load it: a CUBIN needs a driver of the NVRTC's major
/// version or newer, PTX one of its version or newer. The error names both versions and what to
/// install.
pub fn check_driver(target: Target, nvrtc: &NvrtcLibrary, driver: i32) -> Result<()> {
    let (major, minor) = nvrtc.version;
    let needed = match target {
        Target::Cubin(_) => (major, 0),
        Target::Ptx(_) => (major, minor),
    };
    let have = (
        u32::try_from(driver / 1000).unwrap_or(0),
        u32::try_from(driver % 1000 / 10).unwrap_or(0),
    );
    if needed <= have {
        return Ok(());
    }
    let (driver_major, driver_minor) = have;
    let package = match driver_major {
        13.. => "nvidia-cuda-nvrtc".to_string(),
        _ => format!("nvidia-cuda-nvrtc-cu{driver_major}"),
    };
    Err(Error::Cuda(format!(
        "NVRTC {major}.{minor} ({}) is newer than the CUDA {driver_major}.{driver_minor} \
         driver: its {target} needs a CUDA {}.{} driver or newer. Update the driver, or use an \
         NVRTC for CUDA {driver_major}.{driver_minor} (`pip install \
         '{package}=={driver_major}.{driver_minor}.*'` puts it in site-packages/nvidia/*/lib, \
         where sdp4bit looks when the loader finds no NVRTC; or name it with \
         {NVRTC_LIBRARY_VAR})",
        nvrtc.path.display(),
        needed.0,
        needed.1,
    )))
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

    /// An NVRTC of `version` (a CUDA 13 wheel's path, for the messages).
    fn nvrtc(version: (u32, u32)) -> NvrtcLibrary {
        NvrtcLibrary {
            path: "/wheels/libnvrtc.so.13".into(),
            version,
            builtins: "/wheels/libnvrtc-builtins.so.13.0".into(),
        }
    }

    /// A CUBIN loads on drivers of the NVRTC's major version or newer, whatever the minor
    /// versions; an older major version is refused, naming both versions, the NVRTC and what to
    /// install.
    #[test]
    fn cubin_needs_the_nvrtcs_major_version() {
        let cubin = Target::Cubin(Arch::SM_90);
        for (version, driver) in [((13, 0), 13000), ((13, 2), 13000), ((12, 9), 13010)] {
            check_driver(cubin, &nvrtc(version), driver).expect("promised to load");
        }
        let e = check_driver(cubin, &nvrtc((13, 0)), 12090).expect_err("CUDA 12 driver");
        let message = e.to_string();
        for needle in [
            "NVRTC 13.0 (/wheels/libnvrtc.so.13) is newer than the CUDA 12.9 driver",
            "CUBIN for sm_90 needs a CUDA 13.0 driver",
            "pip install 'nvidia-cuda-nvrtc-cu12==12.9.*'",
            "SDP4BIT_NVRTC_LIBRARY",
        ] {
            assert!(message.contains(needle), "{needle}: {message}");
        }
    }

    /// PTX loads only on drivers at least as new as the NVRTC, minor version included.
    #[test]
    fn ptx_needs_the_nvrtcs_version() {
        let ptx = Target::Ptx(Arch::SM_90);
        for (version, driver) in [((13, 0), 13000), ((12, 9), 12090), ((12, 9), 13000)] {
            check_driver(ptx, &nvrtc(version), driver).expect("the driver knows the PTX");
        }
        let e = check_driver(ptx, &nvrtc((13, 1)), 13000).expect_err("PTX of CUDA 13.1");
        let message = e.to_string();
        assert!(
            message.contains("PTX for compute_90 needs a CUDA 13.1 driver")
                && message.contains("'nvidia-cuda-nvrtc==13.0.*'"),
            "{message}"
        );
        check_driver(Target::Cubin(Arch::SM_90), &nvrtc((13, 1)), 13000)
            .expect("its CUBIN loads on CUDA 13.0");
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

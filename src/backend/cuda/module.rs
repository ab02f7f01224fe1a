//! The per-device kernel cache: every source compiled once for the device's architecture,
//! loaded into the device's primary context (the one torch uses), and the kernel handles kept
//! for the life of the process.

use std::collections::HashMap;
use std::ffi::{CString, c_void};
use std::sync::{Mutex, OnceLock};

use cudarc::driver::result::{self as driver, DriverError};
use cudarc::driver::sys::{self, CUdevice_attribute};
use rayon::prelude::*;

use super::compile::{Arch, compile_for};
use super::probe;
use super::source::{Kernel, SOURCES};
use super::target::{self, TargetChoice};
use crate::error::{Error, Result};

/// The kernels of one device, ready to launch: one launch method per kernel.
///
/// Obtained once per device with [`Kernels::get`] and kept for the life of the process: the
/// modules are never unloaded and the primary context stays retained.
#[derive(Debug)]
pub struct Kernels {
    ordinal: usize,
    arch: Arch,
    choice: TargetChoice,
    driver_version: i32,
    multiprocessors: u32,
    context: sys::CUcontext,
    functions: [sys::CUfunction; Kernel::COUNT],
}

// SAFETY: `context` and `functions` are opaque driver handles that are never dereferenced on
// the host; the CUDA driver API may be called with them from any thread.
unsafe impl Send for Kernels {}
// SAFETY: as for `Send`; `Kernels` is immutable after construction.
unsafe impl Sync for Kernels {}

/// Number of CUDA devices: `Ok(0)` when the driver loads but finds no device, an error when
/// the driver library is missing or fails to initialise. Never panics.
pub fn device_count() -> Result<usize> {
    probe::driver()?;
    match driver::init() {
        Ok(()) => {}
        Err(DriverError(sys::CUresult::CUDA_ERROR_NO_DEVICE)) => return Ok(0),
        Err(e) => return Err(driver_error("cuInit")(e)),
    }
    let count = driver::device::get_count().map_err(driver_error("cuDeviceGetCount"))?;
    Ok(usize::try_from(count).unwrap_or(0))
}

/// Maps a driver error to [`Error::Cuda`] naming the call.
pub(crate) fn driver_error(call: &'static str) -> impl Fn(DriverError) -> Error {
    move |e| Error::Cuda(format!("{call} failed: {e}"))
}

impl Kernels {
    /// The kernels of device `ordinal`: compiled by NVRTC for the device's architecture and
    /// loaded into its primary context on first use (seconds), then returned from the cache.
    /// Errors (no driver, no such device, a compile or load failure) are values and are not
    /// cached, so a later call tries again.
    pub fn get(ordinal: usize) -> Result<&'static Kernels> {
        static CACHE: OnceLock<Mutex<HashMap<usize, &'static Kernels>>> = OnceLock::new();
        let cache = CACHE.get_or_init(Default::default);
        // Nothing panics while the lock is held, so poisoning cannot happen; tolerate it anyway.
        let mut cache = cache
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some(kernels) = cache.get(&ordinal) {
            return Ok(kernels);
        }
        let kernels: &'static Kernels = Box::leak(Box::new(Self::load(ordinal)?));
        cache.insert(ordinal, kernels);
        Ok(kernels)
    }

    /// The device ordinal.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// The device's architecture (its compute capability).
    pub fn arch(&self) -> Arch {
        self.arch
    }

    /// What the kernels were compiled to for this device, and why.
    pub fn target(&self) -> &TargetChoice {
        &self.choice
    }

    /// The driver's CUDA version (`cuDriverGetVersion`: 1000 * major + 10 * minor).
    pub fn driver_version(&self) -> i32 {
        self.driver_version
    }

    /// One line for logs and bug reports: the device, the driver, the NVRTC and the image the
    /// kernels were loaded as, with the reason.
    pub fn describe(&self) -> String {
        let nvrtc = probe::nvrtc_library()
            .map(|n| {
                format!(
                    "NVRTC {}.{} ({})",
                    n.version.0,
                    n.version.1,
                    n.path.display()
                )
            })
            .unwrap_or_else(|e| e.to_string());
        format!(
            "CUDA device {} ({}, driver {}), {nvrtc}: {} ({})",
            self.ordinal,
            self.arch,
            format_driver_version(self.driver_version),
            self.choice.target,
            self.choice.reason
        )
    }

    /// Streaming multiprocessors of the device (sizes the launch grids).
    pub(crate) fn multiprocessors(&self) -> u32 {
        self.multiprocessors
    }

    /// The handle of `kernel`.
    pub(crate) fn function(&self, kernel: Kernel) -> sys::CUfunction {
        self.functions[kernel as usize]
    }

    /// Runs `f` with this device's primary context current on the calling thread, restoring
    /// the caller's context afterwards (nothing to do when it is already current, as on a
    /// thread where torch has selected the device).
    pub(crate) fn with_context<R>(&self, f: impl FnOnce() -> Result<R>) -> Result<R> {
        let current = driver::ctx::get_current().map_err(driver_error("cuCtxGetCurrent"))?;
        if current == Some(self.context) {
            return f();
        }
        with_pushed(self.context, f)
    }

    /// Initialises the driver, retains the primary context of device `ordinal`, compiles
    /// every source for its architecture and loads the modules.
    fn load(ordinal: usize) -> Result<Self> {
        let count = device_count()?;
        if ordinal >= count {
            return Err(Error::Cuda(format!(
                "CUDA device {ordinal} requested, the driver sees {count} device(s)"
            )));
        }
        let ordinal_c = i32::try_from(ordinal)
            .map_err(|_| Error::Cuda(format!("CUDA device ordinal {ordinal} is too large")))?;
        let device = driver::device::get(ordinal_c).map_err(driver_error("cuDeviceGet"))?;
        let attribute = |attribute| {
            // SAFETY: `device` was returned by `cuDeviceGet`.
            let value = unsafe { driver::device::get_attribute(device, attribute) }
                .map_err(driver_error("cuDeviceGetAttribute"))?;
            u32::try_from(value).map_err(|_| {
                Error::Cuda(format!("device {ordinal} reports {attribute:?} = {value}"))
            })
        };
        let arch = Arch {
            major: attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
            minor: attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
        };
        let multiprocessors =
            attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?.max(1);
        let driver_version = probe::driver_version()?;
        let nvrtc = probe::nvrtc_library()?;
        let choice = target::choose(arch, &target::supported_archs()?, nvrtc.version)?;
        target::check_driver(choice.target, nvrtc, driver_version)?;
        let image_target = choice.target;
        // NVRTC is thread-safe: compile the sources in parallel.
        let compiled = SOURCES
            .par_iter()
            .map(|source| compile_for(source, image_target).map(|c| (source, c.image())))
            .collect::<Result<Vec<_>>>()?;
        // SAFETY: `device` was returned by `cuDeviceGet`; the retained context is never
        // released (the kernels live as long as the process).
        let context = unsafe { driver::primary_ctx::retain(device) }
            .map_err(driver_error("cuDevicePrimaryCtxRetain"))?;
        let functions = with_pushed(context, || {
            let mut functions = [std::ptr::null_mut(); Kernel::COUNT];
            for (source, image) in &compiled {
                // SAFETY: `image` is a CUBIN (an ELF image, which carries its own size) or a
                // NUL-terminated PTX text, as `Compiled::image` makes it; the context is
                // current.
                let module = unsafe { driver::module::load_data(image.as_ptr().cast::<c_void>()) }
                    .map_err(|e| {
                        Error::Cuda(format!(
                            "cuModuleLoadData of kernels/{} ({image_target}) on device {ordinal} \
                             ({arch}, driver {}) failed: {e}",
                            source.file,
                            format_driver_version(driver_version),
                        ))
                    })?;
                for &kernel in source.kernels {
                    let name = CString::new(kernel.name()).map_err(|_| {
                        Error::Cuda(format!("kernel name {:?} holds a NUL", kernel.name()))
                    })?;
                    // SAFETY: `module` was just loaded and is never unloaded.
                    functions[kernel as usize] =
                        unsafe { driver::module::get_function(module, name) }.map_err(|e| {
                            Error::Cuda(format!(
                                "kernels/{} has no kernel {}: {e}",
                                source.file,
                                kernel.name()
                            ))
                        })?;
                }
            }
            Ok(functions)
        })?;
        Ok(Self {
            ordinal,
            arch,
            choice,
            driver_version,
            multiprocessors,
            context,
            functions,
        })
    }
}

/// `13000` as `13.0`.
pub fn format_driver_version(version: i32) -> String {
    format!("{}.{}", version / 1000, version % 1000 / 10)
}

/// Runs `f` with `context` pushed as the current context, then pops it (also when `f` fails).
fn with_pushed<R>(context: sys::CUcontext, f: impl FnOnce() -> Result<R>) -> Result<R> {
    // SAFETY: `context` is a retained primary context, never released.
    unsafe { sys::cuCtxPushCurrent_v2(context) }
        .result()
        .map_err(driver_error("cuCtxPushCurrent"))?;
    let result = f();
    let mut popped = std::ptr::null_mut();
    // SAFETY: pops the context pushed above; `popped` receives its handle.
    let pop = unsafe { sys::cuCtxPopCurrent_v2(&mut popped) }
        .result()
        .map_err(driver_error("cuCtxPopCurrent"));
    let value = result?;
    pop?;
    Ok(value)
}

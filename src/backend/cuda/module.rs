//! The per-device kernels: each specialisation a job launches ([`KernelSpec`]) compiled at
//! first use for the device's architecture (through the on-disk [`cache`](super::cache), so
//! once per node and never again after a restart), loaded into the device's primary context
//! (the one torch uses), and its handle kept for the life of the process.

use std::collections::HashMap;
use std::ffi::{CString, c_void};
use std::path::PathBuf;
use std::sync::{Mutex, OnceLock};

use cudarc::driver::result::{self as driver, DriverError};
use cudarc::driver::sys::{self, CUdevice_attribute};
use rayon::prelude::*;

use super::cache;
use super::compile::{Arch, compile_for};
use super::probe;
use super::source::Kernel;
use super::spec::{Constants, KernelSpec, Variant};
use super::target::{self, TargetChoice};
use super::tuned;
use super::variants::{default_variant, table_variant};
use crate::error::{Error, Result};

/// The kernels of one device, ready to launch: one launch method per kernel of the table, each
/// launching the specialisation of its configuration.
///
/// Obtained once per device with [`Kernels::get`] and kept for the life of the process: the
/// modules are never unloaded and the primary context stays retained.
#[derive(Debug)]
pub struct Kernels {
    ordinal: usize,
    arch: Arch,
    choice: TargetChoice,
    driver_version: i32,
    nvrtc_version: (u32, u32),
    name: String,
    multiprocessors: u32,
    context: sys::CUcontext,
    cache_dir: Option<PathBuf>,
    /// The loaded specialisations, by entry name.
    functions: Mutex<HashMap<String, Function>>,
    /// The variants chosen for this device (tuned, or set by a caller), by kernel and
    /// constants; the others are the table's or the default's ([`variant`](Self::variant)).
    chosen: Mutex<HashMap<(Kernel, Constants), Variant>>,
}

/// A loaded kernel's handle.
#[derive(Debug, Clone, Copy)]
struct Function(sys::CUfunction);

// SAFETY: an opaque driver handle that is never dereferenced on the host; the CUDA driver API
// may be called with it from any thread.
unsafe impl Send for Function {}

// SAFETY: `context` is an opaque driver handle that is never dereferenced on the host; the CUDA
// driver API may be called with it from any thread; the loaded functions are behind a mutex.
unsafe impl Send for Kernels {}
// SAFETY: as for `Send`.
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
    /// The kernels of device `ordinal`: the device probed, its primary context retained and
    /// the NVRTC checked on first use, then returned from the cache. Errors (no driver, no such
    /// device, no usable NVRTC) are values and are not cached, so a later call tries again.
    /// Kernels themselves compile at first use ([`prepare`](Self::prepare)).
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

    /// The NVRTC's version (major, minor) the kernels compile with.
    pub fn nvrtc_version(&self) -> (u32, u32) {
        self.nvrtc_version
    }

    /// The device's name (`cuDeviceGetName`).
    pub fn device_name(&self) -> &str {
        &self.name
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

    /// The variant `kernel` launches with for `constants` (spec.rs): the one chosen for this
    /// device ([`set_variant`](Self::set_variant), the autotune), else the table's for its
    /// architecture, else the default ([`default_variant`]).
    pub fn variant(&self, kernel: Kernel, constants: Constants) -> Variant {
        let chosen = self
            .chosen
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .get(&(kernel, constants))
            .copied();
        chosen
            .or_else(|| table_variant(self.arch, kernel, constants))
            .unwrap_or_else(|| default_variant(kernel, constants))
    }

    /// Whether a variant of `kernel` with `constants` was chosen for this device (tuned, read
    /// from the record of an earlier tuning, or set).
    pub fn is_chosen(&self, kernel: Kernel, constants: Constants) -> bool {
        self.chosen
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .contains_key(&(kernel, constants))
    }

    /// Makes `kernel` with `constants` launch with `variant` on this device from now on (every
    /// variant computes the same bytes); an error for a variant the kernels do not compile.
    pub fn set_variant(
        &self,
        kernel: Kernel,
        constants: Constants,
        variant: Variant,
    ) -> Result<()> {
        variant.check(constants)?;
        self.chosen
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .insert((kernel, constants), variant);
        Ok(())
    }

    /// The entry names of the specialisations compiled or loaded so far, sorted.
    pub fn loaded(&self) -> Vec<String> {
        let mut names: Vec<String> = self.lock_functions().keys().cloned().collect();
        names.sort();
        names
    }

    /// Compiles (or reads from the cache) and loads every spec of `specs` not loaded yet, in
    /// parallel: what a bucket calls at set-up for the kernels its steps launch, so that no
    /// step compiles.
    pub fn prepare(&self, specs: &[KernelSpec]) -> Result<()> {
        let mut missing: Vec<KernelSpec> = {
            let loaded = self.lock_functions();
            specs
                .iter()
                .filter(|s| !loaded.contains_key(&s.entry()))
                .copied()
                .collect()
        };
        missing.sort_by_key(KernelSpec::entry);
        missing.dedup_by_key(|s| s.entry());
        if missing.is_empty() {
            return Ok(());
        }
        let target = self.choice.target;
        let images = missing
            .par_iter()
            .map(|spec| {
                let code = spec.source();
                let key = cache::key(&code, target, self.nvrtc_version, self.driver_version);
                cache::image(self.cache_dir.as_deref(), &key, || {
                    compile_for(spec, target).map(|c| c.image())
                })
                .map(|image| (spec, image))
            })
            .collect::<Result<Vec<_>>>()?;
        let loaded = self.with_context(|| {
            images
                .iter()
                .map(|(spec, image)| self.load_image(spec, image).map(|f| (spec.entry(), f)))
                .collect::<Result<Vec<_>>>()
        })?;
        self.lock_functions().extend(loaded);
        Ok(())
    }

    /// The handle of `spec`, compiled and loaded now when it was not prepared.
    pub(crate) fn function(&self, spec: &KernelSpec) -> Result<sys::CUfunction> {
        if let Some(f) = self.lock_functions().get(&spec.entry()) {
            return Ok(f.0);
        }
        self.prepare(std::slice::from_ref(spec))?;
        Ok(self.lock_functions()[&spec.entry()].0)
    }

    /// The loaded functions (nothing panics while the lock is held, so poisoning cannot
    /// happen; tolerate it anyway).
    fn lock_functions(&self) -> std::sync::MutexGuard<'_, HashMap<String, Function>> {
        self.functions
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Loads `image`, `spec`'s compiled program, as a module of the current context and returns
    /// its entry point.
    fn load_image(&self, spec: &KernelSpec, image: &[u8]) -> Result<Function> {
        // SAFETY: `image` is a CUBIN (an ELF image, which carries its own size) or a
        // NUL-terminated PTX text, as `Compiled::image` makes it (and the cache returns it
        // byte for byte); the context is current.
        let module = unsafe { driver::module::load_data(image.as_ptr().cast::<c_void>()) }
            .map_err(|e| {
                Error::Cuda(format!(
                    "cuModuleLoadData of {spec} ({}) on device {} ({}, driver {}) failed: {e}",
                    self.choice.target,
                    self.ordinal,
                    self.arch,
                    format_driver_version(self.driver_version),
                ))
            })?;
        let name = CString::new(spec.entry())
            .map_err(|_| Error::Cuda(format!("kernel name {spec} holds a NUL")))?;
        // SAFETY: `module` was just loaded and is never unloaded.
        let function = unsafe { driver::module::get_function(module, name) }
            .map_err(|e| Error::Cuda(format!("the module of {spec} has no kernel {spec}: {e}")))?;
        Ok(Function(function))
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

    /// Initialises the driver, retains the primary context of device `ordinal` and checks that
    /// the NVRTC found can make images the driver loads; kernels are compiled at first use.
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
        let name = driver::device::get_name(device).map_err(driver_error("cuDeviceGetName"))?;
        let driver_version = probe::driver_version()?;
        let nvrtc = probe::nvrtc_library()?;
        let choice = target::choose(arch, &target::supported_archs()?, nvrtc.version)?;
        target::check_driver(choice.target, nvrtc, driver_version)?;
        // SAFETY: `device` was returned by `cuDeviceGet`; the retained context is never
        // released (the kernels live as long as the process).
        let context = unsafe { driver::primary_ctx::retain(device) }
            .map_err(driver_error("cuDevicePrimaryCtxRetain"))?;
        let kernels = Self {
            ordinal,
            arch,
            choice,
            driver_version,
            nvrtc_version: nvrtc.version,
            name,
            multiprocessors,
            context,
            cache_dir: cache::directory(),
            functions: Mutex::new(HashMap::new()),
            chosen: Mutex::new(HashMap::new()),
        };
        // A device tuned at first use takes what an earlier process of the node chose.
        if tuned::enabled(kernels.arch())
            && let Some(path) = tuned::record_file(
                &kernels.name,
                kernels.choice.target,
                kernels.nvrtc_version,
                kernels.driver_version,
            )
        {
            *kernels.chosen.lock().unwrap_or_else(|p| p.into_inner()) = tuned::read_record(&path);
        }
        Ok(kernels)
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

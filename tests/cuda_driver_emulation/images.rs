//! Which image the kernels load as, and what the emulated driver refuses, as a driver does: a
//! CUBIN for the device's architecture by default; a CUBIN for another architecture refused
//! (`CUDA_ERROR_NO_BINARY_FOR_GPU`); an NVRTC newer than the driver refused by the backend, and
//! its PTX by the driver (`CUDA_ERROR_UNSUPPORTED_PTX_VERSION`); PTX for a device newer than
//! every architecture the NVRTC targets; an error for a device older than all of them; and
//! where NVRTC is found with `LD_LIBRARY_PATH` unset: named by path, in the wheels' directories
//! (the driver's major version preferred), or nowhere (the error lists where it looked). Each
//! runs in a child process, so the emulated device and driver can be configured and the faults
//! the refusals report stay out of the other tests' fault log.

use std::ffi::c_void;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use cudarc::driver::CudaContext;
use cudarc::driver::result::{self as driver, DriverError};
use cudarc::driver::sys::CUresult;
use sdp4bit::backend::cuda::compile::compile_for;
use sdp4bit::backend::cuda::source::Kernel;
use sdp4bit::backend::cuda::spec::{Constants, KernelSpec};
use sdp4bit::backend::cuda::target::supported_archs;
use sdp4bit::backend::cuda::variants::default_variant;
use sdp4bit::backend::cuda::{Arch, Kernels, Target, probe};
use sdp4bit::kernel_check::{Collective, check_bucket};
use sdp4bit::{Config, Preset};
use sdp4bit_test_support::cuda_end_to_end::topologies;
use sdp4bit_test_support::setups::cfg;

use super::child::{assert_child_passed, run_isolated};
use super::library::emulation;

const COMPUTE_CAPABILITY: &str = "SDP4BIT_CUDA_EMULATION_COMPUTE_CAPABILITY";
const DRIVER_VERSION: &str = "SDP4BIT_CUDA_EMULATION_DRIVER_VERSION";

/// Device 0's primary context, current on this thread.
fn bind_device_0() -> Arc<CudaContext> {
    emulation();
    let context = CudaContext::new(0).expect("the primary context of device 0");
    context.bind_to_thread().expect("bind it");
    context
}

/// A specialisation quick to compile: Global-QSGD's absmax with its default variant.
fn small_spec() -> KernelSpec {
    let constants = Constants::Elementwise { stochastic: false };
    let variant = default_variant(Kernel::GlobalAbsmax, constants);
    KernelSpec::new(Kernel::GlobalAbsmax, constants, variant).expect("a specialisation")
}

/// Loads `target`'s image of [`small_spec`] into the current context.
fn load(target: Target) -> Result<(), DriverError> {
    let compiled = compile_for(&small_spec(), target).expect("NVRTC compiles");
    let image = compiled.image();
    // SAFETY: a CUBIN or a NUL-terminated PTX text; a context is current.
    unsafe { driver::module::load_data(image.as_ptr().cast::<c_void>()) }.map(|_| ())
}

/// Every kernel of the sdp4bit and Global-QSGD presets runs and matches the host.
fn kernel_check_passes() {
    let kernels = Kernels::get(0).expect("the kernels load");
    let (_, topology) = topologies().remove(0);
    for preset in [Preset::Sdp4bit, Preset::GlobalQsgd] {
        let config: Config = cfg(preset, &[]);
        for collective in [Collective::GradReduceScatter, Collective::WeightAllGather] {
            check_bucket(kernels, collective, &config, &topology, 1)
                .unwrap_or_else(|e| panic!("{preset} {collective:?}: {e}"));
        }
    }
}

/// By default the kernels load as CUBINs for the device's sm_90 (every kernel's parameters
/// read from the CUBIN's `.nv.info` agree with its host build); PTX for compute_90 loads too;
/// CUBINs for sm_86 and sm_100 are refused, naming the architectures.
#[test]
fn cubins_for_the_device_load_and_others_are_refused() {
    let Some(output) = run_isolated(
        "images::cubins_for_the_device_load_and_others_are_refused",
        &[],
        || {
            let _context = bind_device_0();
            let kernels = Kernels::get(0).expect("the kernels load");
            assert_eq!(kernels.target().target, Target::Cubin(Arch::SM_90));
            let line = kernels.describe();
            assert!(line.contains("CUBIN for sm_90"), "{line}");
            assert!(line.contains("driver 13.0"), "{line}");
            kernel_check_passes();
            load(Target::Ptx(Arch::SM_90)).expect("PTX for compute_90 loads");
            for (arch, name) in [(86, "sm_86"), (100, "sm_100")] {
                let arch = Arch {
                    major: arch / 10,
                    minor: arch % 10,
                };
                let refused = load(Target::Cubin(arch)).expect_err("another architecture");
                assert_eq!(refused.0, CUresult::CUDA_ERROR_NO_BINARY_FOR_GPU, "{name}");
                let faults = emulation().take_faults(-1);
                assert!(
                    faults.contains(&format!(
                        "CUBIN: a CUBIN for {name} cannot run on device 0 of compute capability 9.0"
                    )),
                    "{faults}"
                );
            }
        },
    ) else {
        return;
    };
    assert_child_passed(&output);
}

/// On a CUDA 12.9 driver NVRTC 13's images are refused before any is loaded, naming both
/// versions and the NVRTC to install (a CUBIN of another major CUDA version is not promised to
/// load, which the emulation cannot show); its PTX (ISA 9.x) is what the driver itself refuses.
/// Needs NVRTC 13 or newer; `cubins_for_the_device_load_and_others_are_refused` is the control
/// on a CUDA 13.0 driver.
#[test]
fn nvrtc_newer_than_the_driver_is_refused() {
    let Some(output) = run_isolated(
        "images::nvrtc_newer_than_the_driver_is_refused",
        &[(DRIVER_VERSION, Some("12090"))],
        || {
            // The driver first: the probe asks it which NVRTC of SDP4BIT_NVRTC_DIRS to take.
            emulation();
            let (major, minor) = probe::nvrtc_library().expect("NVRTC").version;
            if major < 13 {
                println!("skipped: NVRTC {major}.{minor} is not newer than a CUDA 12.9 driver");
                return;
            }
            let _context = bind_device_0();
            let refused = load(Target::Ptx(Arch::SM_90)).expect_err("PTX ISA 9.x on CUDA 12.9");
            assert_eq!(refused.0, CUresult::CUDA_ERROR_UNSUPPORTED_PTX_VERSION);
            let faults = emulation().take_faults(-1);
            assert!(
                faults.contains(&format!(
                    "needs a CUDA {major}.{minor} driver, this one is 12.9"
                )),
                "{faults}"
            );
            let message = Kernels::get(0)
                .expect_err("NVRTC 13 on CUDA 12")
                .to_string();
            for needle in [
                format!("NVRTC {major}.{minor} ("),
                "newer than the CUDA 12.9 driver".into(),
                format!("CUBIN for sm_90 needs a CUDA {major}.0 driver"),
                "'nvidia-cuda-nvrtc-cu12==12.9.*'".into(),
            ] {
                assert!(message.contains(&needle), "{needle}: {message}");
            }
            assert!(emulation().take_faults(-1).is_empty(), "nothing was loaded");
        },
    ) else {
        return;
    };
    assert_child_passed(&output);
}

/// A device newer than every architecture the NVRTC targets (compute capability 99.0, so
/// whatever the NVRTC) gets PTX for the newest of them, which it runs; the reason says so.
#[test]
fn newer_device_gets_ptx() {
    let Some(output) = run_isolated(
        "images::newer_device_gets_ptx",
        &[(COMPUTE_CAPABILITY, Some("99.0"))],
        || {
            let _context = bind_device_0();
            let newest = *supported_archs()
                .expect("NVRTC lists its architectures")
                .last()
                .expect("at least one");
            let kernels = Kernels::get(0).expect("the kernels load as PTX");
            assert_eq!(kernels.target().target, Target::Ptx(newest));
            let reason = &kernels.target().reason;
            assert!(
                reason.contains("cannot target the device's sm_990"),
                "{reason}"
            );
            kernel_check_passes();
        },
    ) else {
        return;
    };
    assert_child_passed(&output);
}

/// A device older than every architecture the NVRTC targets (3.0; NVRTC 11 and later start
/// at sm_35 or newer) is an error naming both.
#[test]
fn older_device_is_an_error() {
    let Some(output) = run_isolated(
        "images::older_device_is_an_error",
        &[(COMPUTE_CAPABILITY, Some("3.0"))],
        || {
            let _context = bind_device_0();
            let oldest = supported_archs().expect("NVRTC lists its architectures")[0];
            let e = Kernels::get(0).expect_err("no architecture for sm_30");
            let message = e.to_string();
            assert!(
                message.contains("sm_30") && message.contains(&oldest.to_string()),
                "{message}"
            );
        },
    ) else {
        return;
    };
    assert_child_passed(&output);
}

/// The CUDA 13 NVRTC these tests load by path: `SDP4BIT_CUDA_TEST_NVRTC` (how a child gets
/// it), else the one in a directory of this process's `LD_LIBRARY_PATH` (the test command
/// puts the wheel's there) or `SDP4BIT_NVRTC_DIRS` (cargo points it at the wheel's, see
/// build.rs); `None`, to skip, unless `SDP4BIT_REQUIRE_NVRTC=1`.
fn wheel_nvrtc() -> Option<PathBuf> {
    let found = std::env::var_os("SDP4BIT_CUDA_TEST_NVRTC")
        .map(PathBuf::from)
        .or_else(|| {
            ["LD_LIBRARY_PATH", probe::NVRTC_DIRS_VAR]
                .into_iter()
                .filter_map(std::env::var_os)
                .flat_map(|dirs| std::env::split_paths(&dirs).collect::<Vec<_>>())
                .map(|dir| dir.join("libnvrtc.so.13"))
                .find(|path| path.exists())
        });
    if found.is_none() {
        assert_ne!(
            std::env::var("SDP4BIT_REQUIRE_NVRTC").as_deref(),
            Ok("1"),
            "SDP4BIT_REQUIRE_NVRTC=1 but no libnvrtc.so.13 on LD_LIBRARY_PATH or in \
             SDP4BIT_NVRTC_DIRS"
        );
        println!("skipped: no libnvrtc.so.13 on LD_LIBRARY_PATH or in SDP4BIT_NVRTC_DIRS");
    }
    found
}

/// With `LD_LIBRARY_PATH` unset and the wheel's NVRTC named by `SDP4BIT_NVRTC_LIBRARY`,
/// every kernel compiles (NVRTC's builtins are loaded from beside it) and loads.
#[test]
fn nvrtc_by_path_compiles_without_ld_library_path() {
    let Some(path) = wheel_nvrtc() else {
        return;
    };
    let path_text = path.to_string_lossy().into_owned();
    let Some(output) = run_isolated(
        "images::nvrtc_by_path_compiles_without_ld_library_path",
        &[
            ("LD_LIBRARY_PATH", None),
            (probe::NVRTC_LIBRARY_VAR, Some(&path_text)),
            ("SDP4BIT_CUDA_TEST_NVRTC", Some(&path_text)),
        ],
        || {
            assert!(std::env::var_os("LD_LIBRARY_PATH").is_none());
            let nvrtc = probe::nvrtc_library().expect("NVRTC loads by path");
            let wanted = wheel_nvrtc().unwrap();
            assert_eq!(
                nvrtc.path.canonicalize().unwrap(),
                wanted.canonicalize().unwrap()
            );
            let dir = wanted.parent().unwrap();
            let builtins = format!(
                "libnvrtc-builtins.so.{}.{}",
                nvrtc.version.0, nvrtc.version.1
            );
            assert_eq!(nvrtc.builtins, dir.join(builtins));
            let spec = small_spec();
            let compiled = compile_for(&spec, Target::Cubin(Arch::SM_90))
                .unwrap_or_else(|e| panic!("{spec}: {e}"));
            assert!(compiled.cubin.starts_with(b"\x7fELF"), "{spec}");
            let _context = bind_device_0();
            let kernels = Kernels::get(0).expect("the kernels load");
            assert!(
                kernels.describe().contains(&dir.display().to_string()),
                "{}",
                kernels.describe()
            );
        },
    ) else {
        return;
    };
    assert_child_passed(&output);
}

/// A directory of its own under the temporary directory, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("sdp4bit-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("create a temporary directory");
        Self(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// With `LD_LIBRARY_PATH` and `SDP4BIT_NVRTC_LIBRARY` unset, as in a torch user's process,
/// NVRTC is found in the directories of `SDP4BIT_NVRTC_DIRS` (a CUDA 12 wheel's holding a
/// stand-in `libnvrtc.so.12`, then the CUDA 13 wheel's), the one of the driver's major version:
/// on a CUDA 13.0 driver the CUDA 13 NVRTC, whose builtins are loaded from beside it and whose
/// kernels load; on a CUDA 12.9 driver the stand-in, whose load fails naming it.
#[test]
fn nvrtc_of_the_drivers_version_is_found_in_the_wheel_dirs() {
    let Some(path) = wheel_nvrtc() else {
        return;
    };
    let site = TempDir::new("nvrtc-wheels");
    let cu12 = site.0.join("nvidia/cuda_nvrtc/lib");
    std::fs::create_dir_all(&cu12).unwrap();
    std::fs::write(cu12.join("libnvrtc.so.12"), b"not a library").unwrap();
    let dirs = std::env::join_paths([&cu12, path.parent().unwrap()]).unwrap();
    let dirs = dirs.to_string_lossy().into_owned();
    let path_text = path.to_string_lossy().into_owned();
    let env = |driver| {
        [
            ("LD_LIBRARY_PATH", None),
            (probe::NVRTC_LIBRARY_VAR, None),
            (probe::NVRTC_DIRS_VAR, Some(dirs.as_str())),
            ("SDP4BIT_CUDA_TEST_NVRTC", Some(path_text.as_str())),
            (DRIVER_VERSION, Some(driver)),
        ]
    };
    let test = "images::nvrtc_of_the_drivers_version_is_found_in_the_wheel_dirs";
    for driver in ["13000", "12090"] {
        let Some(output) = run_isolated(test, &env(driver), || {
            emulation();
            let found = probe::nvrtc_library();
            if std::env::var(DRIVER_VERSION).unwrap() == "12090" {
                let message = found.expect_err("the stand-in is no library").to_string();
                assert!(
                    message
                        .contains("nvidia/cuda_nvrtc/lib/libnvrtc.so.12 (from SDP4BIT_NVRTC_DIRS)"),
                    "{message}"
                );
                return;
            }
            let nvrtc = found.expect("the CUDA 13 wheel's NVRTC");
            let wanted = wheel_nvrtc().unwrap().canonicalize().unwrap();
            assert_eq!(nvrtc.path.canonicalize().unwrap(), wanted);
            assert!(nvrtc.builtins.starts_with(wanted.parent().unwrap()));
            let _context = bind_device_0();
            let kernels = Kernels::get(0).expect("the kernels load");
            assert_eq!(kernels.target().target, Target::Cubin(Arch::SM_90));
        }) else {
            return;
        };
        assert_child_passed(&output);
    }
}

/// Where no NVRTC is found the error names `SDP4BIT_NVRTC_LIBRARY` and lists where it looked:
/// cudarc's names with `LD_LIBRARY_PATH`, and the directories of `SDP4BIT_NVRTC_DIRS`. Skips
/// where the loader finds an NVRTC without `LD_LIBRARY_PATH` (a system-wide CUDA).
#[test]
fn missing_nvrtc_names_where_it_looked() {
    let empty = TempDir::new("nvrtc-none");
    let dirs = std::env::join_paths([empty.0.as_path(), Path::new("/nonexistent/nvidia/cu13/lib")])
        .unwrap();
    let dirs = dirs.to_string_lossy().into_owned();
    let Some(output) = run_isolated(
        "images::missing_nvrtc_names_where_it_looked",
        &[
            ("LD_LIBRARY_PATH", None),
            (probe::NVRTC_LIBRARY_VAR, None),
            (probe::NVRTC_DIRS_VAR, Some(&dirs)),
        ],
        || {
            emulation();
            let message = match probe::nvrtc_library() {
                Ok(found) => {
                    println!("skipped: the loader finds {}", found.path.display());
                    return;
                }
                Err(e) => e.to_string(),
            };
            let dirs = std::env::var_os(probe::NVRTC_DIRS_VAR).unwrap();
            let mut needles = vec![
                "libnvrtc.so.13".to_string(),
                "LD_LIBRARY_PATH=<unset>".into(),
                "SDP4BIT_NVRTC_LIBRARY".into(),
                "SDP4BIT_NVRTC_DIRS".into(),
                "nvidia-cuda-nvrtc-cu12".into(),
            ];
            needles.extend(std::env::split_paths(&dirs).map(|d| d.display().to_string()));
            for needle in needles {
                assert!(message.contains(&needle), "{needle}: {message}");
            }
            let e = Kernels::get(0).expect_err("no NVRTC").to_string();
            assert_eq!(e, message, "the kernels fail with the probe's error");
        },
    ) else {
        return;
    };
    assert_child_passed(&output);
}

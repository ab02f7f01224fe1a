//! NVRTC compilation of one specialised kernel ([`KernelSpec`]) to a CUBIN for one
//! architecture (with its PTX), or to PTX only for a virtual architecture (see
//! [`super::target`] for which is used when).
//!
//! A spec's program includes its kernel's `.cu` file, which includes the headers of `kernels/`;
//! all of them are handed to NVRTC in memory (cudarc's `create_program` passes no headers, so
//! the program is created here through `nvrtcCreateProgram` itself). Options pin the
//! arithmetic docs/numerics.md §1.4 needs for bit-identity with the CPU backend: no FMA
//! contraction, IEEE division, no flush-to-zero.

use std::ffi::{CString, c_char, c_int};
use std::fmt;

use cudarc::nvrtc::{result, sys};

use super::probe;
use super::source::{HEADERS, SOURCES};
use super::spec::KernelSpec;
use crate::error::{Error, Result};

/// A GPU architecture `sm_<major><minor>` (the device's compute capability).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Arch {
    /// Compute capability major version.
    pub major: u32,
    /// Compute capability minor version.
    pub minor: u32,
}

impl Arch {
    /// Hopper (H100, H200): the project's GPU target.
    pub const SM_90: Arch = Arch { major: 9, minor: 0 };
}

impl fmt::Display for Arch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "sm_{}{}", self.major, self.minor)
    }
}

/// What a compilation produces for the driver.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Target {
    /// Machine code for the real architecture `sm_XY` (a CUBIN), which the driver loads as is
    /// on devices of that major version and at least that minor version.
    Cubin(Arch),
    /// PTX for the virtual architecture `compute_XY`, which the driver compiles at load time
    /// for any device of at least that compute capability, if the driver is at least as new as
    /// the PTX's `.version`.
    Ptx(Arch),
}

impl fmt::Display for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Target::Cubin(arch) => write!(f, "CUBIN for {arch}"),
            Target::Ptx(arch) => write!(f, "PTX for compute_{}{}", arch.major, arch.minor),
        }
    }
}

impl Target {
    /// NVRTC's `--gpu-architecture` value.
    fn option(self) -> String {
        match self {
            Target::Cubin(arch) => format!("--gpu-architecture={arch}"),
            Target::Ptx(arch) => format!("--gpu-architecture=compute_{}{}", arch.major, arch.minor),
        }
    }
}

/// The result of a successful compilation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Compiled {
    /// What was compiled for.
    pub target: Target,
    /// The PTX text (without the terminating NUL).
    pub ptx: String,
    /// The CUBIN (an ELF image) for [`Target::Cubin`]; empty for [`Target::Ptx`].
    pub cubin: Vec<u8>,
    /// NVRTC's program log: empty unless the compiler warned (tests treat warnings as errors).
    pub log: String,
}

impl Compiled {
    /// The image `cuModuleLoadData` takes for the target: the CUBIN, or the PTX with its
    /// terminating NUL.
    pub fn image(&self) -> Vec<u8> {
        match self.target {
            Target::Cubin(_) => self.cubin.clone(),
            Target::Ptx(_) => {
                let mut text = self.ptx.clone().into_bytes();
                text.push(0);
                text
            }
        }
    }
}

/// Compiles `spec` to a CUBIN (and its PTX) for the real architecture `arch`; see
/// [`compile_for`].
pub fn compile(spec: &KernelSpec, arch: Arch) -> Result<Compiled> {
    compile_for(spec, Target::Cubin(arch))
}

/// The NVRTC options every compilation passes besides the target.
pub const OPTIONS: [&str; 5] = [
    "--fmad=false",
    "--prec-div=true",
    "--ftz=false",
    "--std=c++17",
    "-default-device",
];

/// Compiles `spec`'s source ([`KernelSpec::source`]) for `target` with the kernel sources and
/// headers of `kernels/` in memory.
///
/// Options: `--gpu-architecture=sm_XY` (or `compute_XY`) and [`OPTIONS`]. A compile error is an
/// [`Error::Cuda`] carrying NVRTC's log; so is a missing NVRTC library (probed before cudarc is
/// called).
pub fn compile_for(spec: &KernelSpec, target: Target) -> Result<Compiled> {
    compile_program(&spec.entry(), &spec.source(), target)
}

/// Compiles the program `code` (named `name` in NVRTC's messages) for `target`.
pub fn compile_program(name: &str, code: &str, target: Target) -> Result<Compiled> {
    probe::nvrtc()?;
    let program = Program::new(name, code)?;
    let mut options = vec![target.option()];
    options.extend(OPTIONS.iter().map(|o| o.to_string()));
    // SAFETY: `program.handle` was created by `nvrtcCreateProgram` and is destroyed only when
    // `program` drops, after this call.
    let compiled = unsafe { result::compile_program(program.handle, &options) };
    let log = program.log()?;
    match compiled {
        Ok(()) => Ok(Compiled {
            target,
            ptx: program.ptx()?,
            cubin: match target {
                Target::Cubin(_) => program.cubin()?,
                Target::Ptx(_) => Vec::new(),
            },
            log,
        }),
        Err(e) => Err(Error::Cuda(format!(
            "NVRTC could not compile {name} to {target} ({e}):\n{log}"
        ))),
    }
}

/// An NVRTC program, destroyed on drop, with the strings it was created from (NVRTC may keep
/// pointers into them until it is destroyed).
struct Program {
    handle: sys::nvrtcProgram,
    _strings: Vec<CString>,
}

impl Program {
    /// Creates the program `code` named `name` with [`HEADERS`] and [`SOURCES`] as its
    /// in-memory include files.
    fn new(name: &str, code: &str) -> Result<Self> {
        let c = |what: &str, text: &str| {
            CString::new(text)
                .map_err(|_| Error::Cuda(format!("{what} of {name} holds a NUL byte")))
        };
        let includes: Vec<(&str, &str)> = HEADERS
            .iter()
            .copied()
            .chain(SOURCES.iter().map(|s| (s.file, s.code)))
            .collect();
        let code = c("the source", code)?;
        let program_name = c("the name", name)?;
        let mut contents = Vec::with_capacity(includes.len());
        let mut names = Vec::with_capacity(includes.len());
        for (include, text) in &includes {
            contents.push(c(include, text)?);
            names.push(c(include, include)?);
        }
        let content_ptrs: Vec<*const c_char> = contents.iter().map(|s| s.as_ptr()).collect();
        let name_ptrs: Vec<*const c_char> = names.iter().map(|s| s.as_ptr()).collect();
        let mut handle: sys::nvrtcProgram = std::ptr::null_mut();
        // SAFETY: every pointer is a NUL-terminated string owned by `code`, `program_name`,
        // `contents` or `names`, which the returned `Program` keeps alive until it destroys
        // the handle; the two arrays hold `includes.len()` pointers each, as passed.
        let status = unsafe {
            sys::nvrtcCreateProgram(
                &mut handle,
                code.as_ptr(),
                program_name.as_ptr(),
                includes.len() as c_int,
                content_ptrs.as_ptr(),
                name_ptrs.as_ptr(),
            )
        };
        status.result().map_err(|e| {
            Error::Cuda(format!("NVRTC could not create the program of {name}: {e}"))
        })?;
        let mut strings = vec![code, program_name];
        strings.extend(contents);
        strings.extend(names);
        Ok(Self {
            handle,
            _strings: strings,
        })
    }

    /// The program log (empty when the compiler had nothing to say).
    fn log(&self) -> Result<String> {
        // SAFETY: `self.handle` is a live program (destroyed only in `drop`).
        let log = unsafe { result::get_program_log(self.handle) }
            .map_err(|e| Error::Cuda(format!("NVRTC could not return the program log: {e}")))?;
        Ok(text(&log).trim_end().to_owned())
    }

    /// The PTX of the compiled program.
    fn ptx(&self) -> Result<String> {
        // SAFETY: `self.handle` is a live program (destroyed only in `drop`) that compiled.
        let ptx = unsafe { result::get_ptx(self.handle) }
            .map_err(|e| Error::Cuda(format!("NVRTC could not return the PTX: {e}")))?;
        Ok(text(&ptx))
    }

    /// The CUBIN of the compiled program (compiled for a real architecture).
    fn cubin(&self) -> Result<Vec<u8>> {
        let mut size = 0usize;
        // SAFETY: `self.handle` is a live program that compiled; `size` receives its size.
        unsafe { sys::nvrtcGetCUBINSize(self.handle, &mut size) }
            .result()
            .map_err(|e| Error::Cuda(format!("NVRTC could not size the CUBIN: {e}")))?;
        let mut cubin = vec![0u8; size];
        if size > 0 {
            // SAFETY: `cubin` holds the `size` bytes NVRTC reported.
            unsafe { sys::nvrtcGetCUBIN(self.handle, cubin.as_mut_ptr().cast::<c_char>()) }
                .result()
                .map_err(|e| Error::Cuda(format!("NVRTC could not return the CUBIN: {e}")))?;
        }
        if !cubin.starts_with(b"\x7fELF") {
            return Err(Error::Cuda(format!(
                "NVRTC returned a CUBIN of {size} bytes that is not an ELF image"
            )));
        }
        Ok(cubin)
    }
}

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: the handle is live and destroyed exactly once, here. A failure to destroy
        // leaks the program and has no other consequence.
        let _ = unsafe { result::destroy_program(self.handle) };
    }
}

/// The text of a NUL-terminated `c_char` buffer as returned by NVRTC.
fn text(chars: &[c_char]) -> String {
    let bytes: Vec<u8> = chars
        .iter()
        .map(|&c| c as u8)
        .take_while(|&b| b != 0)
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

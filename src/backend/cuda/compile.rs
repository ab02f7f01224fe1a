//! NVRTC compilation of one kernel source to a CUBIN for one architecture (with its PTX), or
//! to PTX only for a virtual architecture (see [`super::target`] for which is used when).
//!
//! The sources include the headers of `kernels/` (`common.cuh`, `sdp4bit_abi.h` and the kernel
//! table it includes), which are handed to NVRTC in memory (cudarc's `create_program` passes no
//! headers, so the program is created here through `nvrtcCreateProgram` itself). Options pin
//! the arithmetic docs/numerics.md §1.4 needs for bit-identity with the CPU backend: no FMA
//! contraction, IEEE division, no flush-to-zero.

use std::ffi::{CString, c_char, c_int};
use std::fmt;

use cudarc::nvrtc::{result, sys};

use super::probe;
use super::source::{HEADERS, KernelSource};
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

/// Compiles `source` to a CUBIN (and its PTX) for the real architecture `arch`; see
/// [`compile_for`].
pub fn compile(source: &KernelSource, arch: Arch) -> Result<Compiled> {
    compile_for(source, Target::Cubin(arch))
}

/// Compiles `source` for `target` with the two shared headers in memory.
///
/// Options: `--gpu-architecture=sm_XY` (or `compute_XY`) `--fmad=false --prec-div=true
/// --ftz=false --std=c++17 -default-device`. A compile error is an [`Error::Cuda`] carrying
/// NVRTC's log; so is a missing NVRTC library (probed before cudarc is called).
pub fn compile_for(source: &KernelSource, target: Target) -> Result<Compiled> {
    probe::nvrtc()?;
    let program = Program::new(source)?;
    let options = [
        target.option(),
        "--fmad=false".into(),
        "--prec-div=true".into(),
        "--ftz=false".into(),
        "--std=c++17".into(),
        "-default-device".into(),
    ];
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
            "NVRTC could not compile kernels/{} to {target} ({e}):\n{log}",
            source.file
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
    /// Creates the program of `source` with [`HEADERS`] as its in-memory include files.
    fn new(source: &KernelSource) -> Result<Self> {
        let c = |what: &str, text: &str| {
            CString::new(text).map_err(|_| {
                Error::Cuda(format!(
                    "{what} of kernels/{} holds a NUL byte",
                    source.file
                ))
            })
        };
        let code = c("the source", source.code)?;
        let name = c("the name", source.file)?;
        let mut contents = Vec::with_capacity(HEADERS.len());
        let mut names = Vec::with_capacity(HEADERS.len());
        for (include, text) in HEADERS {
            contents.push(c(include, text)?);
            names.push(c(include, include)?);
        }
        let content_ptrs: Vec<*const c_char> = contents.iter().map(|s| s.as_ptr()).collect();
        let name_ptrs: Vec<*const c_char> = names.iter().map(|s| s.as_ptr()).collect();
        let mut handle: sys::nvrtcProgram = std::ptr::null_mut();
        // SAFETY: every pointer is a NUL-terminated string owned by `code`, `name`,
        // `contents` or `names`, which the returned `Program` keeps alive until it destroys
        // the handle; the two arrays hold `HEADERS.len()` pointers each, as passed.
        let status = unsafe {
            sys::nvrtcCreateProgram(
                &mut handle,
                code.as_ptr(),
                name.as_ptr(),
                HEADERS.len() as c_int,
                content_ptrs.as_ptr(),
                name_ptrs.as_ptr(),
            )
        };
        status.result().map_err(|e| {
            Error::Cuda(format!(
                "NVRTC could not create the program of kernels/{}: {e}",
                source.file
            ))
        })?;
        let mut strings = vec![code, name];
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

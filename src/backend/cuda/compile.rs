//! NVRTC compilation of one kernel source to PTX.
//!
//! The sources include `sdp4bit_abi.h` and `common.cuh`; both are handed to NVRTC in memory
//! (cudarc's `create_program` passes no headers, so the program is created here through
//! `nvrtcCreateProgram` itself). Options pin the arithmetic docs/numerics.md §1.4 needs for
//! bit-identity with the CPU backend: no FMA contraction, IEEE division, no flush-to-zero.

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

/// The result of a successful compilation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Compiled {
    /// The PTX text (without the terminating NUL).
    pub ptx: String,
    /// NVRTC's program log: empty unless the compiler warned (tests treat warnings as errors).
    pub log: String,
}

/// Compiles `source` for `arch` to PTX with the two shared headers in memory.
///
/// Options: `--gpu-architecture=sm_XY --fmad=false --prec-div=true --ftz=false --std=c++17
/// -default-device`. A compile error is an [`Error::Cuda`] carrying NVRTC's log; so is a
/// missing NVRTC library (probed before cudarc is called).
pub fn compile(source: &KernelSource, arch: Arch) -> Result<Compiled> {
    probe::nvrtc()?;
    let program = Program::new(source)?;
    let options = [
        format!("--gpu-architecture={arch}"),
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
            ptx: program.ptx()?,
            log,
        }),
        Err(e) => Err(Error::Cuda(format!(
            "NVRTC could not compile kernels/{} for {arch} ({e}):\n{log}",
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

//! Static resources of the compiled kernels, read without a GPU: `ptxas -v` assembles NVRTC's
//! PTX for sm_90 and reports registers, spills and stack per kernel; `nvdisasm` prints the
//! SASS, whose instructions are counted here (shuffles, votes, global loads and stores by
//! width, local-memory traffic). Used by `tests/cuda_compile.rs` (the CI check) and
//! `bench/kernels.rs` (the table in `bench/results/kernels.md`).
//!
//! The tools come from PyPI (`scripts/env.sh`, `sdp4bit_cuda_tools`), which puts their
//! directory in `SDP4BIT_CUDA_BIN`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The target every figure is for.
pub const GPU_NAME: &str = "sm_90";

/// Registers of one sm_90 multiprocessor.
const REGISTERS_PER_MULTIPROCESSOR: u32 = 65536;
/// Resident warps of one sm_90 multiprocessor at most.
const MAX_WARPS_PER_MULTIPROCESSOR: u32 = 64;
/// Warps of one block of every kernel (256 threads).
const WARPS_PER_BLOCK: u32 = 8;

/// The assembler and the disassembler.
#[derive(Debug, Clone)]
pub struct CudaTools {
    ptxas: PathBuf,
    nvdisasm: PathBuf,
}

impl CudaTools {
    /// The tools in `SDP4BIT_CUDA_BIN`; an error naming what is missing otherwise.
    pub fn from_env() -> Result<Self, String> {
        let dir = std::env::var_os("SDP4BIT_CUDA_BIN").ok_or(
            "SDP4BIT_CUDA_BIN is not set (source scripts/env.sh and run sdp4bit_cuda_tools, \
             which installs ptxas and nvdisasm from PyPI into .cache/)",
        )?;
        let dir = PathBuf::from(dir);
        let tool = |name: &str| {
            let path = dir.join(name);
            if path.is_file() {
                Ok(path)
            } else {
                Err(format!("no {name} in SDP4BIT_CUDA_BIN={}", dir.display()))
            }
        };
        Ok(Self {
            ptxas: tool("ptxas")?,
            nvdisasm: tool("nvdisasm")?,
        })
    }

    /// ptxas's version line (`Cuda compilation tools, release ...`).
    pub fn ptxas_version(&self) -> Result<String, String> {
        let out = run(Command::new(&self.ptxas).arg("--version"))?;
        Ok(out
            .lines()
            .find(|l| l.starts_with("Cuda compilation tools"))
            .unwrap_or("unknown version")
            .to_owned())
    }

    /// Assembles `ptx` (the PTX of kernels/`file`) for sm_90 in `dir` and returns the
    /// resources of every entry point, in the order ptxas reports them.
    pub fn analyse(
        &self,
        file: &str,
        ptx: &str,
        dir: &Path,
    ) -> Result<Vec<KernelResources>, String> {
        let (report, cubin) = self.assemble(file, ptx, dir)?;
        let counts = count_sass(&self.disassemble_cubin(&cubin)?);
        parse_ptxas_report(&report)?
            .into_iter()
            .map(|(name, usage)| {
                let sass = counts
                    .get(&name)
                    .cloned()
                    .ok_or_else(|| format!("kernels/{file}: no SASS of {name}"))?;
                Ok(KernelResources { name, usage, sass })
            })
            .collect()
    }

    /// `ptxas -v` of `ptx` (the PTX of kernels/`file`) for sm_90 in `dir`: its report and the
    /// SASS listing (`nvdisasm -c`).
    pub fn report_and_listing(
        &self,
        file: &str,
        ptx: &str,
        dir: &Path,
    ) -> Result<(String, String), String> {
        let (report, cubin) = self.assemble(file, ptx, dir)?;
        Ok((report, self.disassemble_cubin(&cubin)?))
    }

    /// The SASS listing (`nvdisasm -c`) of `ptx` assembled for sm_90 in `dir`.
    pub fn disassemble(&self, file: &str, ptx: &str, dir: &Path) -> Result<String, String> {
        let (_, cubin) = self.assemble(file, ptx, dir)?;
        self.disassemble_cubin(&cubin)
    }

    /// The SASS listing with the source line of every instruction (`nvdisasm -c -gi`, each
    /// instruction preceded by its `//## File "...", line N` comments, innermost first) of `ptx`
    /// compiled with NVRTC's `-lineinfo` and assembled for sm_90 with `ptxas -lineinfo`.
    pub fn disassemble_with_lines(
        &self,
        file: &str,
        ptx: &str,
        dir: &Path,
    ) -> Result<String, String> {
        let stem = file.trim_end_matches(".cu");
        let ptx_path = dir.join(format!("{stem}-lines.ptx"));
        let cubin = dir.join(format!("{stem}-lines.cubin"));
        std::fs::write(&ptx_path, ptx).map_err(|e| format!("write {}: {e}", ptx_path.display()))?;
        run(Command::new(&self.ptxas)
            .args(["-lineinfo", "--gpu-name", GPU_NAME])
            .arg(&ptx_path)
            .arg("-o")
            .arg(&cubin))?;
        run(Command::new(&self.nvdisasm).args(["-c", "-gi"]).arg(&cubin))
    }

    /// `ptxas -v` of `ptx`, written to `dir` as `file` with the extension `.ptx`: its report
    /// and the cubin's path.
    fn assemble(&self, file: &str, ptx: &str, dir: &Path) -> Result<(String, PathBuf), String> {
        let stem = file.trim_end_matches(".cu");
        let ptx_path = dir.join(format!("{stem}.ptx"));
        let cubin = dir.join(format!("{stem}.cubin"));
        std::fs::write(&ptx_path, ptx).map_err(|e| format!("write {}: {e}", ptx_path.display()))?;
        let report = run(Command::new(&self.ptxas)
            .args(["-v", "--gpu-name", GPU_NAME])
            .arg(&ptx_path)
            .arg("-o")
            .arg(&cubin))?;
        Ok((report, cubin))
    }

    fn disassemble_cubin(&self, cubin: &Path) -> Result<String, String> {
        run(Command::new(&self.nvdisasm).arg("-c").arg(cubin))
    }
}

/// Runs `command`; its stdout and stderr together, or an error with them.
fn run(command: &mut Command) -> Result<String, String> {
    let out = command
        .output()
        .map_err(|e| format!("start {:?}: {e}", command.get_program()))?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    if out.status.success() {
        Ok(text)
    } else {
        Err(format!(
            "{:?} failed ({}):\n{text}",
            command.get_program(),
            out.status
        ))
    }
}

/// What ptxas reports for one entry point.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Usage {
    /// Registers per thread.
    pub registers: u32,
    /// Bytes of the stack frame.
    pub stack_frame: u32,
    /// Bytes stored to and loaded from local memory because registers ran out.
    pub spill_stores: u32,
    /// See `spill_stores`.
    pub spill_loads: u32,
}

impl Usage {
    /// Whether anything lives in local memory (spills or a stack frame).
    pub fn uses_local_memory(&self) -> bool {
        self.stack_frame + self.spill_stores + self.spill_loads > 0
    }

    /// Resident warps per multiprocessor over the most it holds (64), for blocks of 256
    /// threads, as the registers allow (registers are allocated per warp in units of 256).
    pub fn occupancy(&self) -> f64 {
        let per_warp = (self.registers.max(1) * 32).div_ceil(256) * 256;
        let warps = REGISTERS_PER_MULTIPROCESSOR / per_warp;
        let blocks = warps / WARPS_PER_BLOCK;
        f64::from((blocks * WARPS_PER_BLOCK).min(MAX_WARPS_PER_MULTIPROCESSOR))
            / f64::from(MAX_WARPS_PER_MULTIPROCESSOR)
    }
}

/// The entry points of a `ptxas -v` report with their usage.
pub fn parse_ptxas_report(report: &str) -> Result<Vec<(String, Usage)>, String> {
    let mut kernels: Vec<(String, Usage)> = Vec::new();
    let number_before = |line: &str, what: &str| -> Option<u32> {
        let end = line.find(what)?;
        line[..end].split_whitespace().last()?.parse().ok()
    };
    // Whether the next stack line is the entry point's own (ptxas lists the functions it calls
    // out of line after it, each with its own).
    let mut own = false;
    for line in report.lines() {
        if let Some(rest) = line.split("Compiling entry function '").nth(1) {
            let name = rest.split('\'').next().unwrap_or_default().to_owned();
            kernels.push((name, Usage::default()));
            continue;
        }
        let Some((name, usage)) = kernels.last_mut() else {
            continue;
        };
        if let Some(function) = line.split("Function properties for ").nth(1) {
            own = function.trim() == name.as_str();
            continue;
        }
        if line.contains("bytes stack frame") && own {
            usage.stack_frame = number_before(line, "bytes stack frame")
                .ok_or_else(|| format!("{name}: unreadable line `{line}`"))?;
            usage.spill_stores = number_before(line, "bytes spill stores")
                .ok_or_else(|| format!("{name}: unreadable line `{line}`"))?;
            usage.spill_loads = number_before(line, "bytes spill loads")
                .ok_or_else(|| format!("{name}: unreadable line `{line}`"))?;
        } else if line.contains("Used") && line.contains("registers") {
            usage.registers = number_before(line, "registers")
                .ok_or_else(|| format!("{name}: unreadable line `{line}`"))?;
        }
    }
    if kernels.is_empty() || kernels.iter().any(|(_, u)| u.registers == 0) {
        return Err(format!("no register count per entry point in:\n{report}"));
    }
    Ok(kernels)
}

/// Instruction counts of one kernel's SASS (static: each instruction of the code once,
/// whichever paths and loop trips run).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SassCounts {
    /// Every instruction (NOP padding excluded).
    pub instructions: u32,
    /// Warp shuffles (`SHFL`).
    pub shuffles: u32,
    /// Warp votes (`VOTE`, `VOTEU`).
    pub votes: u32,
    /// Global loads by access width in bits.
    pub loads: BTreeMap<u32, u32>,
    /// Global stores by access width in bits.
    pub stores: BTreeMap<u32, u32>,
    /// Local-memory loads and stores (`LDL`, `STL`) of the entry point's own code.
    pub local: u32,
    /// Those of the functions it calls out of line (the register saves of a cold path's call,
    /// which run only when it is taken).
    pub local_in_calls: u32,
}

impl SassCounts {
    /// The widest global load, in bits (0: none).
    pub fn widest_load(&self) -> u32 {
        self.loads.keys().copied().max().unwrap_or(0)
    }

    /// The widest global store, in bits (0: none).
    pub fn widest_store(&self) -> u32 {
        self.stores.keys().copied().max().unwrap_or(0)
    }
}

/// The access width in bits of a global load or store opcode (`LDG.E.128.CONSTANT`: 128;
/// `STG.E.U8`: 8; no width suffix: 32).
fn access_width(opcode: &str) -> u32 {
    for part in opcode.split('.').skip(1) {
        match part {
            "U8" | "S8" => return 8,
            "U16" | "S16" => return 16,
            "64" => return 64,
            "128" => return 128,
            _ => {}
        }
    }
    32
}

/// The SASS instruction counts of every function of `nvdisasm -c` output, by name.
pub fn count_sass(listing: &str) -> BTreeMap<String, SassCounts> {
    let mut functions: BTreeMap<String, SassCounts> = BTreeMap::new();
    let mut current: Option<String> = None;
    // Whether the instructions are those of a function the entry point calls (listed after its
    // own code in its section, each from a `.type NAME,@function` line).
    let mut called = false;
    for line in listing.lines() {
        let trimmed = line.trim();
        if let Some(section) = trimmed.strip_prefix(".text.") {
            if let Some(name) = section.strip_suffix(':') {
                current = Some(name.to_owned());
                called = false;
                functions.entry(name.to_owned()).or_default();
            }
            continue;
        }
        let Some(name) = &current else { continue };
        if trimmed.starts_with(".type") && trimmed.ends_with("@function") {
            called = true;
            continue;
        }
        // `/*0040*/  @!P0 LDG.E.128.CONSTANT R4, desc[UR4][R2.64] ;`
        let Some(rest) = trimmed.strip_prefix("/*") else {
            continue;
        };
        let Some((_, instruction)) = rest.split_once("*/") else {
            continue;
        };
        let mut words = instruction.split_whitespace();
        let mut opcode = words.next().unwrap_or_default();
        if opcode.starts_with('@') {
            opcode = words.next().unwrap_or_default();
        }
        if opcode.is_empty() || opcode == "NOP" {
            continue;
        }
        let counts = functions.get_mut(name).expect("entry made above");
        counts.instructions += 1;
        let base = opcode.split('.').next().unwrap_or_default();
        match base {
            "SHFL" => counts.shuffles += 1,
            "VOTE" | "VOTEU" => counts.votes += 1,
            "LDG" => *counts.loads.entry(access_width(opcode)).or_default() += 1,
            "STG" => *counts.stores.entry(access_width(opcode)).or_default() += 1,
            "LDL" | "STL" if called => counts.local_in_calls += 1,
            "LDL" | "STL" => counts.local += 1,
            _ => {}
        }
    }
    functions
}

/// One kernel's resources.
#[derive(Debug, Clone)]
pub struct KernelResources {
    /// The entry point.
    pub name: String,
    /// ptxas's report.
    pub usage: Usage,
    /// The SASS counts.
    pub sass: SassCounts,
}

//! Bit-identity of every CUDA kernel with the CPU backend, without a GPU: g++ compiles the
//! kernels of `kernels/` unchanged against a host emulation of the CUDA device environment
//! (`tests/kernel_emulator/`: each warp runs as 32 cooperative fibers that meet at every
//! shuffle and vote; see `cuda_shim.h` for the model and its limits), and the emulator runs
//! launches that this test generates from the CPU backend.
//!
//! Each case holds fresh random inputs (fixed seed), launch parameters built by the CUDA
//! backend's own `abi` constructors (so the `#[repr(C)]` mirrors are checked against the C
//! structs too), a grid of 1, 2 or 3 blocks (so the grid-stride loops run) or as many blocks
//! as the work units need, a warp order (forward, reverse or shuffled), and the CPU backend's
//! output for the same inputs. The data hold NaN / Inf groups, signed zeros, denormals, values near `f32::MAX` and
//! odd shard sizes. The sweep covers:
//! - gradients: TLq-HS (H16, H32, H64 with 4/8-bit nearest, H256 over 512- and 768-element
//!   groups, 32-element groups), TLq (96-element groups, 4/8-bit nearest), ZeRO++, QSDP
//!   (8-bit and 4-bit, nearest and stochastic); topologies 2x2, 2x2 with interleaved ranks,
//!   1x4, 4x1, 2x3, 3x2 interleaved and two with unequal nodes; P = 1 and 3; all three passes;
//! - weights: every weight codec (qwd, qw, qsdp, zeropp) with several bit widths, group sizes
//!   and roundings, W = 1 to 4, encode (also at a bucket index past 2^32 Philox blocks) and
//!   apply;
//! - Global-QSGD: absmax, int8 / int16 rounding (stochastic and nearest) and dequantization;
//! - corrupt received slabs (negative or infinite scales, infinite offsets, the symmetric code
//!   -2^(b-1)), which the kernels decode to NaN where the CPU returns `Error::Decode`: the
//!   expected output is the CPU's for the same slabs with those groups made non-finite (scale
//!   and offset NaN, codes 0); and unusual but valid metadata (scale -0, a negative NaN, a
//!   denormal) that both must decode alike.
//!
//! Outputs are compared as `tests/cuda_gpu.rs` does: codes and padding byte for byte, scales,
//! offsets, fp32 and bf16 values bit for bit with NaN compared as NaN-ness (a GPU's NaN
//! payloads differ from the host's). A failure names the case, the output and the first
//! difference.
//!
//! The emulator itself fails a case on a divergent warp, an out-of-bounds access (guard pages
//! and canaries around every buffer) or undefined behaviour (UBSan), naming the case, launch
//! and thread.
//!
//! The default run is a third of the sweep that still covers every axis (257 cases, about 10 s
//! on two cores with the g++ build); `SDP4BIT_EMULATOR_FULL=1` runs the whole cross product
//! (801 cases, about 25 s). g++ is required: without
//! it the test fails, unless `SDP4BIT_SKIP_EMULATOR=1`. `SDP4BIT_KERNELS_DIR=DIR` emulates the
//! kernel sources in DIR instead of `kernels/` (e.g. a deliberately broken copy), and
//! `SDP4BIT_TEST_SEED=N` changes the data seed. On failure the work directory (case files,
//! emulator build) is kept and its path printed.

use std::collections::BTreeSet;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use half::bf16;

use sdp4bit::backend::cpu::{global_qsgd, gradient, weight};
use sdp4bit::backend::cuda::abi::{
    SdpGlobal, SdpGradFinal, SdpGradFirst, SdpGradSecond, SdpWeightApply, SdpWeightEncode,
};
use sdp4bit::backend::cuda::source::Kernel;
use sdp4bit::backend::cuda::{absmax_from_bits, dest_table};
use sdp4bit::codec::int_code::IntCode;
use sdp4bit::codec::slab::SlabLayout;
use sdp4bit::codec::weight_encoding::WeightEncoding;
use sdp4bit::collective::global_k;
use sdp4bit::plan::{BucketPlan, GradLayout, GradRoute, Topology, peer_index};
use sdp4bit::rng::{Stage, UniformStream, stream_id};
use sdp4bit::{Config, Preset, Rounding, WeightCodec};

/// The data seed unless `SDP4BIT_TEST_SEED` is set.
const DEFAULT_SEED: u64 = 0x5D94_B17E_0000_0001;

/// How long the emulator may run (the full sweep takes about 25 s on two cores).
const EMULATOR_TIMEOUT: Duration = Duration::from_secs(600);

/// Groups one block handles at a time (8 warps, one group each) and elements one block handles
/// in the element-wise kernels: the launch shape of `backend::cuda::launch`.
const GROUPS_PER_BLOCK: u64 = 8;
const ELEMENTS_PER_BLOCK: u64 = 256;

/// g++ flags of every translation unit. `-ffp-contract=off`: no fused multiply-add, as NVRTC's
/// `--fmad=false`. CUDA's `#pragma unroll` means nothing to g++, hence `-Wno-unknown-pragmas`.
/// UBSan (linked too) stops the emulator at undefined behaviour in a kernel: misaligned
/// accesses (which work on x86 but fault on a GPU), out-of-range shifts and float-to-int
/// conversions, signed overflow.
const CXX_FLAGS: [&str; 11] = [
    "-std=c++20",
    "-O1",
    "-ffp-contract=off",
    "-fno-fast-math",
    "-Wall",
    "-Wextra",
    "-Werror",
    "-Wno-unknown-pragmas",
    "-pthread",
    "-fsanitize=undefined,float-cast-overflow",
    "-fno-sanitize-recover=all",
];

fn flag(name: &str) -> bool {
    std::env::var(name).is_ok_and(|v| v == "1")
}

// ---------------------------------------------------------------------------------------------
// The test.

#[test]
fn kernels_match_the_cpu_backend_under_emulation() {
    if flag("SDP4BIT_SKIP_EMULATOR") {
        println!("skipped: SDP4BIT_SKIP_EMULATOR=1");
        return;
    }
    let full = flag("SDP4BIT_EMULATOR_FULL");
    let seed = std::env::var("SDP4BIT_TEST_SEED")
        .ok()
        .map(|s| s.parse().expect("SDP4BIT_TEST_SEED is a u64"))
        .unwrap_or(DEFAULT_SEED);
    let kernels = std::env::var_os("SDP4BIT_KERNELS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels"));
    require_gxx();
    let work = WorkDir::create();
    let start = Instant::now();

    // g++ builds while the CPU backend computes the cases.
    let (emulator, cases) = std::thread::scope(|s| {
        let build = s.spawn(|| build_emulator(&kernels, work.path()));
        let cases = all_cases(seed, full);
        let emulator = build
            .join()
            .unwrap_or_else(|e| std::panic::resume_unwind(e));
        (emulator, cases)
    });
    let launched: BTreeSet<&str> = cases
        .iter()
        .flat_map(|c| c.launches.iter().map(|l| l.kernel.name()))
        .collect();
    for kernel in Kernel::ALL {
        assert!(
            launched.contains(kernel.name()),
            "no case launches {}",
            kernel.name()
        );
    }
    for (i, case) in cases.iter().enumerate() {
        std::fs::write(work.path().join(format!("{i:04}.case")), case.encode())
            .expect("write a case file");
    }
    let built = start.elapsed();

    let jobs = std::thread::available_parallelism().map_or(1, |n| n.get());
    let (status, stderr) = run_emulator(&emulator, work.path(), jobs);
    let emulated = start.elapsed();

    // Errors the emulator found itself (divergent warps, out-of-bounds accesses, undefined
    // behaviour), then every output that differs from the CPU's.
    let mut failures = Vec::new();
    if !status.success() {
        failures.push(format!("the emulator failed ({status}):"));
        failures.extend(stderr.lines().map(|line| with_case_names(line, &cases)));
    }
    let mut checks = 0;
    let mut missing = 0;
    for (i, case) in cases.iter().enumerate() {
        checks += case.checks.len();
        let Ok(out) = std::fs::read(work.path().join(format!("{i:04}.out"))) else {
            missing += 1;
            continue;
        };
        failures.extend(
            case.compare(&out)
                .into_iter()
                .map(|e| format!("case {i:04} ({}): {e}", case.name)),
        );
    }
    if missing > 0 {
        failures.push(format!(
            "{missing} cases have no output (see the emulator's errors)"
        ));
    }
    let launches: usize = cases.iter().map(|c| c.launches.len()).sum();
    println!(
        "{} cases ({}), {launches} launches, {checks} outputs compared, seed {seed:#x}, \
         {jobs} emulator threads; g++ build and case generation {:.1} s, emulation {:.1} s",
        cases.len(),
        if full { "full sweep" } else { "default subset" },
        built.as_secs_f64(),
        (emulated - built).as_secs_f64()
    );
    if !failures.is_empty() {
        let shown = failures.len().min(25);
        panic!(
            "the emulated kernels do not match the CPU backend (seed {seed:#x}, kernels from {}, \
             {checks} outputs checked); {} problems, the first {shown}:\n{}",
            kernels.display(),
            failures.len(),
            failures[..shown].join("\n")
        );
    }
}

/// Runs the emulator over the case files in `dir` with `jobs` threads; returns its exit status
/// and its stderr (both streams go to files in `dir`). Kills it and fails after
/// [`EMULATOR_TIMEOUT`]: a kernel that never returns would otherwise hang the test.
fn run_emulator(exe: &Path, dir: &Path, jobs: usize) -> (ExitStatus, String) {
    let log = |name: &str| File::create(dir.join(name)).expect("create an emulator log file");
    let mut child = Command::new(exe)
        .arg(dir)
        .arg(jobs.to_string())
        .stdout(log("emulator.stdout"))
        .stderr(log("emulator.stderr"))
        .spawn()
        .expect("start the emulator");
    let deadline = Instant::now() + EMULATOR_TIMEOUT;
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait for the emulator") {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "the emulator did not finish within {} s (a kernel that never returns?)",
                EMULATOR_TIMEOUT.as_secs()
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let stderr = std::fs::read(dir.join("emulator.stderr")).expect("read the emulator's stderr");
    (status, String::from_utf8_lossy(&stderr).into_owned())
}

/// `line` with the name of every case it mentions by number ("case 0042") added.
fn with_case_names(line: &str, cases: &[Case]) -> String {
    let mut out = String::new();
    let mut rest = line;
    while let Some(at) = rest.find("case ") {
        let (head, tail) = rest.split_at(at + "case ".len());
        let digits = tail.len() - tail.trim_start_matches(|c: char| c.is_ascii_digit()).len();
        out += head;
        out += &tail[..digits];
        if let Some(case) = tail[..digits]
            .parse()
            .ok()
            .and_then(|i: usize| cases.get(i))
        {
            out += &format!(" ({})", case.name);
        }
        rest = &tail[digits..];
    }
    out + rest
}

/// A fresh directory for the build and the case files; removed when the test passes, kept
/// (and named on stderr) when it fails.
struct WorkDir(PathBuf);

impl WorkDir {
    fn create() -> Self {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let dir =
            std::env::temp_dir().join(format!("sdp4bit-emulated-{}-{nanos}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("create the work directory");
        Self(dir)
    }

    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for WorkDir {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("kept the emulator work directory {}", self.0.display());
        } else {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Building the emulator.

/// Fails the test unless g++ runs.
fn require_gxx() {
    match Command::new("g++").arg("--version").output() {
        Ok(out) if out.status.success() => {}
        Ok(out) => panic!("`g++ --version` failed ({}); g++ is required", out.status),
        Err(e) => panic!(
            "g++ is required to build the CUDA kernel emulator ({e}); install it, or set \
             SDP4BIT_SKIP_EMULATOR=1 to skip this test"
        ),
    }
}

/// Compiles every `.cu` of `kernels` and the emulator with g++ (in parallel) and links them
/// into `dir/emulator`; panics with the compiler's output on any error or warning.
fn build_emulator(kernels: &Path, dir: &Path) -> PathBuf {
    let harness = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/kernel_emulator");
    let mut sources: Vec<PathBuf> = std::fs::read_dir(kernels)
        .unwrap_or_else(|e| panic!("{}: {e}", kernels.display()))
        .map(|entry| entry.expect("directory entry").path())
        .filter(|path| path.extension().is_some_and(|ext| ext == "cu"))
        .collect();
    sources.sort();
    assert!(!sources.is_empty(), "no .cu file in {}", kernels.display());
    sources.push(harness.join("emulator.cpp"));

    let compiles: Vec<_> = sources
        .iter()
        .map(|source| {
            let stem = source.file_stem().expect("file name").to_string_lossy();
            let object = dir.join(format!("{stem}.o"));
            let child = Command::new("g++")
                .args(CXX_FLAGS)
                .arg("-include")
                .arg(harness.join("cuda_shim.h"))
                .arg("-I")
                .arg(kernels)
                .args(["-x", "c++", "-c"])
                .arg(source)
                .arg("-o")
                .arg(&object)
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .expect("start g++");
            (source, object, child)
        })
        .collect();
    let mut objects = Vec::new();
    let mut errors = String::new();
    for (source, object, child) in compiles {
        let out = child.wait_with_output().expect("wait for g++");
        if !out.status.success() {
            errors += &format!(
                "g++ failed on {}:\n{}{}\n",
                source.display(),
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        objects.push(object);
    }
    assert!(
        errors.is_empty(),
        "building the kernel emulator failed (warnings are errors):\n{errors}"
    );
    let exe = dir.join("emulator");
    let out = Command::new("g++")
        .args(["-pthread", "-fsanitize=undefined"])
        .args(&objects)
        .arg("-o")
        .arg(&exe)
        .output()
        .expect("run g++ to link");
    assert!(
        out.status.success(),
        "linking the kernel emulator failed (it needs g++'s UBSan runtime, libubsan):\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    exe
}

// ---------------------------------------------------------------------------------------------
// Cases: buffers, launches and the outputs expected of them.

/// A buffer of a case (its index).
#[derive(Debug, Clone, Copy)]
struct Buf(u32);

/// How an output buffer is compared with the CPU's.
#[derive(Debug, Clone, Copy)]
enum Expect {
    /// Whole slabs of the layout.
    Slabs(SlabLayout),
    F32,
    Bf16,
    /// Integers of this many bytes.
    Ints(usize),
    /// One `u32` left by `global_absmax`, compared as `absmax_from_bits` of it.
    AbsmaxBits,
}

struct Check {
    buffer: usize,
    what: String,
    expect: Expect,
    want: Vec<u8>,
}

struct Launch {
    kernel: Kernel,
    grid: u32,
    /// 0 forward, 1 reverse, 2 shuffled with `order_seed`.
    order: u32,
    order_seed: u64,
    pointers: Vec<Option<Buf>>,
    params: Vec<u8>,
}

/// The launch parameter structs of `abi`: `#[repr(C)]` with fixed-width fields and no padding
/// (abi.rs asserts their sizes, the sums of their fields), so every byte is initialised.
trait AbiParams: Copy {}
impl AbiParams for SdpGradFirst {}
impl AbiParams for SdpGradSecond {}
impl AbiParams for SdpGradFinal {}
impl AbiParams for SdpWeightEncode {}
impl AbiParams for SdpWeightApply {}
impl AbiParams for SdpGlobal {}

/// The bytes `cuLaunchKernel` would copy for `params`.
fn param_bytes<T: AbiParams>(params: &T) -> Vec<u8> {
    // SAFETY: `params` is a live value of a type without padding (see `AbiParams`), so its
    // `size_of::<T>()` bytes are initialised and readable as u8.
    unsafe { std::slice::from_raw_parts((params as *const T).cast::<u8>(), size_of::<T>()) }
        .to_vec()
}

struct Case {
    name: String,
    /// (is an output, initial bytes).
    buffers: Vec<(bool, Vec<u8>)>,
    launches: Vec<Launch>,
    checks: Vec<Check>,
    /// Picks each launch's grid and warp order.
    shapes: Gen,
}

impl Case {
    fn new(name: String, rand: &mut Gen) -> Self {
        Self {
            name,
            buffers: Vec::new(),
            launches: Vec::new(),
            checks: Vec::new(),
            shapes: Gen(rand.word()),
        }
    }

    fn input(&mut self, bytes: Vec<u8>) -> Buf {
        self.buffers.push((false, bytes));
        Buf(self.buffers.len() as u32 - 1)
    }

    /// An output buffer starting as `initial`, which must end as `want` (from the CPU).
    fn output(&mut self, initial: Vec<u8>, what: String, expect: Expect, want: Vec<u8>) -> Buf {
        assert_eq!(initial.len(), want.len(), "{what}: output sizes");
        self.buffers.push((true, initial));
        let buffer = self.buffers.len() - 1;
        self.checks.push(Check {
            buffer,
            what,
            expect,
            want,
        });
        Buf(buffer as u32)
    }

    /// Launches `kernel` over `units` work units (`per_block` per block), as
    /// `backend::cuda::launch` does, but with a grid of 1, 2 or 3 blocks (grid-stride loops) or
    /// `units / per_block` blocks (rounded up), and one of three warp orders.
    fn launch<T: AbiParams>(
        &mut self,
        kernel: Kernel,
        units: u64,
        per_block: u64,
        pointers: &[Option<Buf>],
        params: &T,
    ) {
        let grid = match self.shapes.below(4) {
            0 => 1,
            1 => 2,
            2 => 3,
            _ => units.div_ceil(per_block).max(1),
        };
        self.launches.push(Launch {
            kernel,
            grid: u32::try_from(grid).expect("grid fits u32"),
            order: self.shapes.below(3) as u32,
            order_seed: self.shapes.word(),
            pointers: pointers.to_vec(),
            params: param_bytes(params),
        });
    }

    /// The case file (format: `tests/kernel_emulator/emulator.cpp`).
    fn encode(&self) -> Vec<u8> {
        let mut out = b"SDPEMU01".to_vec();
        let u32_le = |out: &mut Vec<u8>, v: usize| {
            out.extend(u32::try_from(v).expect("fits u32").to_le_bytes())
        };
        u32_le(&mut out, self.buffers.len());
        for (output, bytes) in &self.buffers {
            out.push(u8::from(*output));
            out.extend((bytes.len() as u64).to_le_bytes());
            out.extend(bytes);
        }
        u32_le(&mut out, self.launches.len());
        for l in &self.launches {
            u32_le(&mut out, l.kernel.name().len());
            out.extend(l.kernel.name().as_bytes());
            out.extend(l.grid.to_le_bytes());
            out.extend(l.order.to_le_bytes());
            out.extend(l.order_seed.to_le_bytes());
            u32_le(&mut out, l.pointers.len());
            for p in &l.pointers {
                out.extend(p.map_or(u32::MAX, |b| b.0).to_le_bytes());
            }
            u32_le(&mut out, l.params.len());
            out.extend(&l.params);
        }
        out
    }

    /// Compares the emulator's output file (the final bytes of the output buffers, in order)
    /// with the expected outputs; one message per differing output.
    fn compare(&self, out: &[u8]) -> Vec<String> {
        let mut got = std::collections::HashMap::new();
        let mut at = 0;
        for (i, (output, bytes)) in self.buffers.iter().enumerate() {
            if *output {
                if at + bytes.len() > out.len() {
                    return vec![format!("output file of {} bytes is too short", out.len())];
                }
                got.insert(i, &out[at..at + bytes.len()]);
                at += bytes.len();
            }
        }
        if at != out.len() {
            return vec![format!("output file of {} bytes, expected {at}", out.len())];
        }
        self.checks
            .iter()
            .filter_map(|c| {
                first_difference(c.expect, &c.want, got[&c.buffer])
                    .map(|e| format!("{}: {e}", c.what))
            })
            .collect()
    }
}

// ---------------------------------------------------------------------------------------------
// Comparisons: the first difference, described.

fn f32_at(bytes: &[u8], i: usize) -> f32 {
    f32::from_le_bytes(bytes[4 * i..4 * i + 4].try_into().expect("4 bytes"))
}

fn same_f32(a: f32, b: f32) -> bool {
    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
}

fn first_difference(expect: Expect, cpu: &[u8], emu: &[u8]) -> Option<String> {
    match expect {
        Expect::Slabs(layout) => slab_difference(layout, cpu, emu),
        Expect::F32 => (0..cpu.len() / 4)
            .find(|&i| !same_f32(f32_at(cpu, i), f32_at(emu, i)))
            .map(|i| {
                let (c, e) = (f32_at(cpu, i), f32_at(emu, i));
                format!(
                    "element {i}: cpu {c:e} ({:#010x}), emulated {e:e} ({:#010x})",
                    c.to_bits(),
                    e.to_bits()
                )
            }),
        Expect::Bf16 => {
            let at =
                |b: &[u8], i: usize| bf16::from_bits(u16::from_le_bytes([b[2 * i], b[2 * i + 1]]));
            (0..cpu.len() / 2)
                .find(|&i| {
                    let (c, e) = (at(cpu, i), at(emu, i));
                    c.to_bits() != e.to_bits() && !(c.is_nan() && e.is_nan())
                })
                .map(|i| {
                    let (c, e) = (at(cpu, i), at(emu, i));
                    format!(
                        "element {i}: cpu {c} ({:#06x}), emulated {e} ({:#06x})",
                        c.to_bits(),
                        e.to_bits()
                    )
                })
        }
        Expect::Ints(width) => {
            let at = |b: &[u8], i: usize| match width {
                1 => i64::from(b[i] as i8),
                _ => i64::from(i16::from_le_bytes([b[2 * i], b[2 * i + 1]])),
            };
            (0..cpu.len() / width)
                .find(|&i| at(cpu, i) != at(emu, i))
                .map(|i| format!("element {i}: cpu {}, emulated {}", at(cpu, i), at(emu, i)))
        }
        Expect::AbsmaxBits => {
            let word = |b: &[u8]| u32::from_le_bytes(b[..4].try_into().expect("4 bytes"));
            let (c, e) = (f32::from_bits(word(cpu)), absmax_from_bits(word(emu)));
            (c.to_bits() != e.to_bits()).then(|| {
                format!(
                    "absmax: cpu {c:e}, emulated {e:e} (bits {:#010x})",
                    word(emu)
                )
            })
        }
    }
}

/// Codes exactly, scales and offsets as floats (NaN as NaN-ness), padding exactly.
fn slab_difference(layout: SlabLayout, cpu: &[u8], emu: &[u8]) -> Option<String> {
    let code_bytes = layout.spec.code_bytes_per_group();
    let codes_len = layout.codes_len();
    let meta_end = codes_len + 4 * layout.groups * layout.spec.meta_words();
    for (s, (c, e)) in cpu
        .chunks_exact(layout.byte_len())
        .zip(emu.chunks_exact(layout.byte_len()))
        .enumerate()
    {
        if let Some(i) = (0..codes_len).find(|&i| c[i] != e[i]) {
            let k = i / code_bytes;
            let scale = |b: &[u8]| f32_at(&b[codes_len..], k);
            return Some(format!(
                "slab {s} group {k}: codes differ at byte {} of the group: cpu {:#04x}, \
                 emulated {:#04x} (cpu scale {:e}, emulated scale {:e})",
                i % code_bytes,
                c[i],
                e[i],
                scale(c),
                scale(e)
            ));
        }
        for w in 0..(meta_end - codes_len) / 4 {
            let (a, b) = (f32_at(&c[codes_len..], w), f32_at(&e[codes_len..], w));
            if !same_f32(a, b) {
                let (what, k) = if w < layout.groups {
                    ("scale", w)
                } else {
                    ("offset", w - layout.groups)
                };
                return Some(format!(
                    "slab {s} group {k}: {what} cpu {a:e} ({:#010x}), emulated {b:e} ({:#010x})",
                    a.to_bits(),
                    b.to_bits()
                ));
            }
        }
        if let Some(i) = (meta_end..c.len()).find(|&i| c[i] != e[i]) {
            return Some(format!(
                "slab {s}: padding byte {} is {:#04x}, expected {:#04x}",
                i - meta_end,
                e[i],
                c[i]
            ));
        }
    }
    None
}

// ---------------------------------------------------------------------------------------------
// Random data.

/// SplitMix64: a small deterministic generator for the test data.
struct Gen(u64);

impl Gen {
    fn word(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.word() % n as u64) as usize
    }

    fn coin(&mut self) -> bool {
        self.word() & 1 == 1
    }

    fn pick<T: Copy>(&mut self, items: &[T]) -> T {
        items[self.below(items.len())]
    }

    /// Uniform in [-1, 1).
    fn signed(&mut self) -> f32 {
        (self.word() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }

    fn nan(&mut self) -> f32 {
        f32::from_bits(self.pick(&[
            0x7FC0_0000,
            0xFFC0_0000,
            0x7F80_0001,
            0xFFFF_FFFF,
            0x7FC1_2345,
        ]))
    }

    /// `n` finite values in (-3, 3), e.g. a sentinel the kernels must overwrite or leave.
    fn plain(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| 3.0 * self.signed()).collect()
    }

    /// `n` values in runs of `run` (a group size), each run plain or special: zeros, signed
    /// zeros, a NaN (assorted payloads), an Inf, denormals, tiny or huge magnitudes (the scale
    /// underflows or overflows), a single `±f32::MAX`, a constant, non-negative values with -0,
    /// magnitudes spread over 60 decades, a single outlier.
    fn values(&mut self, n: usize, run: usize) -> Vec<f32> {
        let mut v = self.plain(n);
        for lo in (0..n).step_by(run.max(1)) {
            let hi = (lo + run).min(n);
            let i = lo + self.below(hi - lo);
            match self.below(16) {
                0 => v[lo..hi].fill(0.0),
                1 => v[lo..hi]
                    .iter_mut()
                    .for_each(|x| *x = if self.coin() { 0.0 } else { -0.0 }),
                2 => v[i] = self.nan(),
                3 => v[i] = self.pick(&[f32::INFINITY, f32::NEG_INFINITY]),
                4 => v[lo..hi]
                    .iter_mut()
                    .for_each(|x| *x = f32::from_bits(self.word() as u32 & 0x807F_FFFF)),
                5 => v[lo..hi].iter_mut().for_each(|x| *x *= 1e-38),
                6 => v[lo..hi].iter_mut().for_each(|x| *x *= 1.1e38),
                7 => v[i] = self.pick(&[f32::MAX, -f32::MAX]),
                8 => {
                    let c = self.signed();
                    v[lo..hi].fill(c);
                }
                9 => v[lo..hi]
                    .iter_mut()
                    .for_each(|x| *x = if self.below(3) == 0 { -0.0 } else { x.abs() }),
                10 => v[lo..hi]
                    .iter_mut()
                    .for_each(|x| *x *= 10f32.powi(self.below(61) as i32 - 30)),
                11 => v[i] = 1e4 * self.signed(),
                _ => {}
            }
        }
        v
    }

    fn bf16s(&mut self, n: usize, run: usize) -> Vec<bf16> {
        self.values(n, run)
            .into_iter()
            .map(bf16::from_f32)
            .collect()
    }

    /// Updated weights: mostly `old` plus a small step, some unchanged, some arbitrary.
    fn updated(&mut self, old: &[bf16]) -> Vec<bf16> {
        old.iter()
            .map(|&x| match self.below(8) {
                0 => x,
                1 => bf16::from_f32(100.0 * self.signed()),
                _ => bf16::from_f32(x.to_f32() + 0.01 * self.signed()),
            })
            .collect()
    }

    /// The stream of `stage` for `rank` of bucket 7, under a random seed and step.
    fn stream(&mut self, rank: usize, stage: Stage) -> UniformStream {
        let step = self.word() % 100_000;
        UniformStream::new(
            self.word(),
            step,
            stream_id(7, rank, stage).expect("stream id"),
        )
    }
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn bf16_bytes(v: &[bf16]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_bits().to_le_bytes()).collect()
}

/// A fresh output buffer: a byte pattern no kernel writes, so untouched bytes show up.
fn garbage(len: usize) -> Vec<u8> {
    vec![0xA5; len]
}

/// Damages a few groups of the slabs in `recv` (slabs of `layout`) the way no encoder writes
/// them: a negative or infinite scale, an infinite offset, the symmetric code -2^(b-1) (also
/// with a NaN scale). Before that, gives a few groups unusual but valid metadata (scale -0, a
/// negative NaN, the smallest denormal, zero with non-zero codes; a NaN offset). Returns the
/// damaged slabs and their twin in which each damaged group is a non-finite group (scale and
/// offset NaN, codes 0): what the kernels decode a corrupt group to (kernels/common.cuh), so
/// the CPU backend's output for the twin is the kernels' expected output.
fn damage(rand: &mut Gen, layout: SlabLayout, recv: &[u8]) -> (Vec<u8>, Vec<u8>) {
    let spec = layout.spec;
    let len = layout.byte_len();
    let slabs = recv.len() / len;
    let code_bytes = spec.code_bytes_per_group();
    let codes_at = |s: usize, k: usize| s * len + k * code_bytes;
    let scale_at = |s: usize, k: usize| s * len + layout.codes_len() + 4 * k;
    let offset_at = |s: usize, k: usize| scale_at(s, k) + 4 * layout.groups;
    let put =
        |bytes: &mut [u8], at: usize, v: f32| bytes[at..at + 4].copy_from_slice(&v.to_le_bytes());

    let mut bad = recv.to_vec();
    for _ in 0..1 + rand.below(2) {
        let (s, k) = (rand.below(slabs), rand.below(layout.groups));
        match rand.below(4) {
            0 => put(&mut bad, scale_at(s, k), -0.0),
            1 => put(&mut bad, scale_at(s, k), f32::from_bits(0xFFC0_0001)),
            2 => put(&mut bad, scale_at(s, k), f32::from_bits(1)),
            _ if spec.symmetric => put(&mut bad, scale_at(s, k), 0.0),
            _ => put(&mut bad, offset_at(s, k), f32::NAN),
        }
    }
    let mut twin = bad.clone();
    for _ in 0..1 + rand.below(3) {
        let (s, k) = (rand.below(slabs), rand.below(layout.groups));
        let negative = -rand.pick(&[f32::from_bits(1), 1e-30, 0.5, 3.0e38]);
        match rand.below(4) {
            0 => put(&mut bad, scale_at(s, k), negative),
            1 => put(
                &mut bad,
                scale_at(s, k),
                rand.pick(&[f32::INFINITY, f32::NEG_INFINITY]),
            ),
            kind if spec.symmetric => {
                // The code -2^(b-1) at element e: nibble 0x8 or byte 0x80.
                let e = rand.below(spec.group_size);
                let at = codes_at(s, k);
                if spec.bits == 4 {
                    let byte = &mut bad[at + e / 2];
                    *byte = if e.is_multiple_of(2) {
                        (*byte & 0xF0) | 0x08
                    } else {
                        (*byte & 0x0F) | 0x80
                    };
                } else {
                    bad[at + e] = 0x80;
                }
                if kind == 3 {
                    put(&mut bad, scale_at(s, k), f32::NAN);
                }
            }
            _ => put(
                &mut bad,
                offset_at(s, k),
                rand.pick(&[f32::INFINITY, f32::NEG_INFINITY]),
            ),
        }
        twin[codes_at(s, k)..codes_at(s, k) + code_bytes].fill(0);
        put(&mut twin, scale_at(s, k), f32::NAN);
        if !spec.symmetric {
            put(&mut twin, offset_at(s, k), f32::NAN);
        }
    }
    (bad, twin)
}

// ---------------------------------------------------------------------------------------------
// The sweep.

/// Gradient codec variants: (name, knobs over the sdp4bit preset with weights off, so the
/// padding is the gradient codec's own).
const GRAD_VARIANTS: [(&str, &[(&str, &str)]); 13] = [
    ("tlq-hs", &[]),
    ("tlq-hs-h16", &[("hadamard_block", "16")]),
    (
        "tlq-hs-g256-h64-4/8-rn",
        &[
            ("grad_group_size", "256"),
            ("hadamard_block", "64"),
            ("grad_intra_bits", "4"),
            ("grad_inter_bits", "8"),
            ("grad_rounding", "nearest"),
        ],
    ),
    (
        "tlq-hs-g512-h256",
        &[("grad_group_size", "512"), ("hadamard_block", "256")],
    ),
    (
        "tlq-hs-g768-h256",
        &[("grad_group_size", "768"), ("hadamard_block", "256")],
    ),
    (
        "tlq-hs-g32-4/4",
        &[("grad_group_size", "32"), ("grad_intra_bits", "4")],
    ),
    (
        "tlq-g96",
        &[("grad_codec", "tlq"), ("grad_group_size", "96")],
    ),
    (
        "tlq-4/8-rn",
        &[
            ("grad_codec", "tlq"),
            ("grad_intra_bits", "4"),
            ("grad_inter_bits", "8"),
            ("grad_rounding", "nearest"),
        ],
    ),
    (
        "tlq-8/8-rn-g160",
        &[
            ("grad_codec", "tlq"),
            ("grad_inter_bits", "8"),
            ("grad_group_size", "160"),
            ("grad_rounding", "nearest"),
        ],
    ),
    ("zeropp", &[("grad_codec", "zeropp")]),
    ("qsdp", &[("grad_codec", "qsdp")]),
    (
        "qsdp-4bit-g64-rn",
        &[
            ("grad_codec", "qsdp"),
            ("grad_inter_bits", "4"),
            ("grad_group_size", "64"),
            ("grad_rounding", "nearest"),
        ],
    ),
    (
        "qsdp-4bit-g320",
        &[
            ("grad_codec", "qsdp"),
            ("grad_inter_bits", "4"),
            ("grad_group_size", "320"),
        ],
    ),
];

/// Topologies as one node label per DP rank: two levels (2x2, also with the nodes' ranks
/// interleaved, 2x3, 3x2 interleaved), the intra-node level only (1x4), the inter-node level
/// only (4x1), and unequal nodes (one level over all ranks).
const TOPOLOGIES: [(&str, &[u64]); 8] = [
    ("2x2", &[0, 0, 1, 1]),
    ("2x2-interleaved", &[0, 1, 0, 1]),
    ("1x4", &[0, 0, 0, 0]),
    ("4x1", &[0, 1, 2, 3]),
    ("2x3", &[0, 0, 0, 1, 1, 1]),
    ("3x2-interleaved", &[0, 1, 0, 1, 2, 2]),
    ("uneven-2+1", &[0, 0, 1]),
    ("uneven-2+3", &[0, 1, 1, 0, 1]),
];

/// Weight codec variants: (name, knobs over the sdp4bit preset).
const WEIGHT_VARIANTS: [(&str, &[(&str, &str)]); 10] = [
    ("qwd", &[]),
    (
        "qwd-8bit-g256",
        &[("weight_bits", "8"), ("weight_group_size", "256")],
    ),
    (
        "qwd-g32-rn",
        &[("weight_group_size", "32"), ("weight_rounding", "nearest")],
    ),
    ("qw", &[("weight_codec", "qw")]),
    (
        "qw-8bit-g96",
        &[
            ("weight_codec", "qw"),
            ("weight_bits", "8"),
            ("weight_group_size", "96"),
        ],
    ),
    ("qsdp", &[("weight_codec", "qsdp")]),
    (
        "qsdp-4bit-g64-rn",
        &[
            ("weight_codec", "qsdp"),
            ("weight_bits", "4"),
            ("weight_group_size", "64"),
            ("weight_rounding", "nearest"),
        ],
    ),
    (
        "qsdp-4bit-g288",
        &[
            ("weight_codec", "qsdp"),
            ("weight_bits", "4"),
            ("weight_group_size", "288"),
        ],
    ),
    ("zeropp", &[("weight_codec", "zeropp")]),
    (
        "zeropp-4bit-g128",
        &[
            ("weight_codec", "zeropp"),
            ("weight_bits", "4"),
            ("weight_group_size", "128"),
        ],
    ),
];

/// Shard lengths of the gradient cases: less than one group, and odd sizes that leave a partial
/// group and padding.
const GRAD_SHARDS: [usize; 3] = [5, 1237, 4099];

/// Shard lengths of the weight cases.
const WEIGHT_SHARDS: [usize; 4] = [7, 2047, 5000, 9000];

fn config(base: &[(&'static str, &'static str)], extra: &[(&'static str, String)]) -> Config {
    let knobs = base
        .iter()
        .copied()
        .chain(extra.iter().map(|(k, v)| (*k, v.as_str())));
    Config::from_overrides(Preset::Sdp4bit, knobs).expect("valid config")
}

/// Every case of the run: the full cross product, or the default subset (about a third) in
/// which every gradient variant meets every topology at P = 1 and 3 (two of the three shard
/// sizes, rotating), every weight variant every world size (shard sizes rotating), and
/// Global-QSGD four of the sizes.
fn all_cases(seed: u64, full: bool) -> Vec<Case> {
    let mut rand = Gen(seed);
    let mut cases = Vec::new();
    for (vi, (variant, knobs)) in GRAD_VARIANTS.iter().enumerate() {
        for (ti, (topo, labels)) in TOPOLOGIES.iter().enumerate() {
            let topology = Topology::from_node_labels(labels).expect("topology");
            let combos: Vec<(usize, usize)> = if full {
                [1, 3]
                    .into_iter()
                    .flat_map(|p| GRAD_SHARDS.map(|s| (p, s)))
                    .collect()
            } else {
                let shard = |i: usize| GRAD_SHARDS[i % GRAD_SHARDS.len()];
                vec![(1, shard(vi + ti)), (3, shard(vi + ti + 1))]
            };
            for (chunks, shard) in combos {
                let config = config(
                    knobs,
                    &[
                        ("weight_codec", "none".into()),
                        ("pipeline_chunks", chunks.to_string()),
                    ],
                );
                let name = format!("grad {variant} {topo} P={chunks} S={shard}");
                cases.push(grad_case(name, &mut rand, &config, &topology, shard));
            }
        }
    }
    for (vi, (variant, knobs)) in WEIGHT_VARIANTS.iter().enumerate() {
        let combos: Vec<(usize, usize)> = if full {
            [1, 2, 3, 4]
                .into_iter()
                .flat_map(|w| WEIGHT_SHARDS.map(|s| (w, s)))
                .collect()
        } else {
            (1..=4)
                .map(|w| (w, WEIGHT_SHARDS[(vi + w) % WEIGHT_SHARDS.len()]))
                .collect()
        };
        for (i, (w, shard)) in combos.into_iter().enumerate() {
            // Pipeline chunks change the padding (the gradient codec's groups times P).
            let chunks = 1 + (vi + i) % 3;
            let config = config(knobs, &[("pipeline_chunks", chunks.to_string())]);
            let name = format!("weight {variant} W={w} S={shard} P={chunks}");
            cases.push(weight_case(name, &mut rand, &config, w, shard, i % 2 == 1));
        }
    }
    let sizes: &[usize] = if full {
        &[1, 5, 255, 1000, 4097, 10_007, 70_001, 100_003]
    } else {
        &[1, 255, 4097, 10_007]
    };
    for &numel in sizes {
        for data in [GlobalData::Plain, GlobalData::Specials] {
            cases.push(global_case(&mut rand, numel, data));
        }
    }
    cases.push(global_case(&mut rand, 777, GlobalData::Zeros));
    cases
}

/// One rank's view of the grouped gradient reduce-scatter: its first pass over the whole
/// bucket, then per chunk the requantization (two-level routes) and the final reduction of
/// what its peers send it, each also with damaged received slabs.
fn grad_case(
    name: String,
    rand: &mut Gen,
    config: &Config,
    topology: &Topology,
    shard_len: usize,
) -> Case {
    let mut case = Case::new(name, rand);
    let w = topology.world();
    let plan = BucketPlan::new(w * shard_len, w, config).expect("plan");
    let route = GradRoute::new(config, topology);
    let layout = GradLayout::new(config, topology, &route, plan).expect("W > 1 has an exchange");
    let first = layout.first;
    let g = config.grad.group_size;
    let me = rand.below(w);
    let my_x1 = peer_index(topology, first.level, me);
    let dests: Vec<u8> = dest_table(&layout)
        .expect("destination table")
        .iter()
        .flat_map(|d| d.to_le_bytes())
        .collect();
    let dests = case.input(dests);

    // The first pass of this rank's bucket.
    let bucket = rand.values(plan.numel, g);
    let rng = rand.stream(me, Stage::GradFirst);
    let mut own = vec![0u8; plan.chunks * first.peers * first.slab.byte_len()];
    gradient::quantize_first(&layout, &bucket, &rng, &mut own);
    let input = case.input(f32_bytes(&bucket));
    let out = case.output(
        garbage(own.len()),
        "grad_quantize_first".into(),
        Expect::Slabs(first.slab),
        own.clone(),
    );
    case.launch(
        Kernel::GradQuantizeFirst,
        (plan.chunks * first.peers * first.slab.groups) as u64,
        GROUPS_PER_BLOCK,
        &[Some(input), Some(dests), Some(out)],
        &SdpGradFirst::new(&layout, &rng).expect("params"),
    );

    // What every first-level peer's first pass sends: this rank's own, the others' of their
    // own random buckets.
    let sent: Vec<Vec<u8>> = (0..first.peers)
        .map(|x1| {
            if x1 == my_x1 {
                return own.clone();
            }
            let bucket = rand.values(plan.numel, g);
            let mut out = vec![0u8; own.len()];
            gradient::quantize_first(
                &layout,
                &bucket,
                &rand.stream(x1, Stage::GradFirst),
                &mut out,
            );
            out
        })
        .collect();

    let len = first.slab.byte_len();
    for p in 0..plan.chunks {
        let k = p * first.peers + my_x1;
        let recv: Vec<u8> = sent
            .iter()
            .flat_map(|o| &o[k * len..(k + 1) * len])
            .copied()
            .collect();
        let last_recv = match layout.second {
            None => recv,
            Some(second) => {
                let rng = rand.stream(me, Stage::GradSecond);
                let params = SdpGradSecond::new(&layout, my_x1, p, &rng).expect("params");
                let cpu = |recv: &[u8]| {
                    let mut out = vec![0u8; second.peers * second.slab.byte_len()];
                    gradient::requantize_second(&layout, my_x1, p, recv, &rng, &mut out)
                        .expect("valid slabs");
                    out
                };
                let want = cpu(&recv);
                let (bad, twin) = damage(rand, first.slab, &recv);
                for (tag, input, want) in
                    [("", &recv, want.clone()), (" damaged", &bad, cpu(&twin))]
                {
                    let input = case.input(input.clone());
                    let out = case.output(
                        garbage(want.len()),
                        format!("grad_requantize_second p={p}{tag}"),
                        Expect::Slabs(second.slab),
                        want,
                    );
                    case.launch(
                        Kernel::GradRequantizeSecond,
                        (second.peers * second.slab.groups) as u64,
                        GROUPS_PER_BLOCK,
                        &[Some(input), Some(dests), Some(out)],
                        &params,
                    );
                }
                // Stand-in for what the second-level peers send: this rank's own slabs.
                want
            }
        };

        // The final reduction of chunk p into a shard holding a sentinel elsewhere.
        let last = layout.last();
        let sentinel = rand.plain(plan.shard_len);
        let cpu = |recv: &[u8]| {
            let mut shard = sentinel.clone();
            gradient::reduce_final(&layout, p, recv, &mut shard).expect("valid slabs");
            f32_bytes(&shard)
        };
        let (bad, twin) = damage(rand, last.slab, &last_recv);
        for (tag, input, want) in [
            ("", &last_recv, cpu(&last_recv)),
            (" damaged", &bad, cpu(&twin)),
        ] {
            let input = case.input(input.clone());
            let out = case.output(
                f32_bytes(&sentinel),
                format!("grad_reduce_final p={p}{tag}"),
                Expect::F32,
                want,
            );
            case.launch(
                Kernel::GradReduceFinal,
                last.slab.groups as u64,
                GROUPS_PER_BLOCK,
                &[Some(input), Some(out)],
                &SdpGradFinal::new(&layout, p).expect("params"),
            );
        }
    }
    case
}

/// The weight all-gather's two passes: this rank encodes its shard (at its padded bucket index,
/// or with `high_index` at one whose Philox blocks cross 2^32), then applies every rank's slab,
/// also with damaged slabs.
fn weight_case(
    name: String,
    rand: &mut Gen,
    config: &Config,
    w: usize,
    shard_len: usize,
    high_index: bool,
) -> Case {
    let mut case = Case::new(name, rand);
    let spec = config.weight.quant_spec().expect("a grouped weight codec");
    let g = spec.group_size;
    let encoding = if config.weight.codec == WeightCodec::Qwd {
        WeightEncoding::Difference
    } else {
        WeightEncoding::Direct
    };
    let difference = encoding == WeightEncoding::Difference;
    let plan = BucketPlan::new(w * shard_len, w, config).expect("plan");
    let layout = SlabLayout {
        spec,
        groups: plan.padded_shard_len / g,
    };
    let me = rand.below(w);

    // Encode this rank's shard; direct encodings pass no reference (a null pointer).
    let reference = rand.bf16s(shard_len, g);
    let new = rand.updated(&reference);
    let rng = rand.stream(me, Stage::Weight);
    let first_index = if high_index {
        (1u64 << 34) - 32 * (1 + rand.below(g / 16)) as u64
    } else {
        plan.padded_index(me, 0)
    };
    let mut want = vec![0u8; layout.byte_len()];
    weight::encode_shard(
        layout,
        encoding,
        first_index,
        &new,
        &reference,
        &rng,
        &mut want,
    );
    let new = case.input(bf16_bytes(&new));
    let reference = difference.then(|| case.input(bf16_bytes(&reference)));
    let out = case.output(
        garbage(want.len()),
        format!("weight_encode at index {first_index}"),
        Expect::Slabs(layout),
        want,
    );
    case.launch(
        Kernel::WeightEncode,
        layout.groups as u64,
        GROUPS_PER_BLOCK,
        &[Some(new), reference, Some(out)],
        &SdpWeightEncode::new(&layout, encoding, shard_len, first_index, &rng).expect("params"),
    );

    // Apply every rank's slab, each the CPU encoding of that rank's update.
    let mut recv = Vec::with_capacity(w * layout.byte_len());
    for z in 0..w {
        let old = rand.bf16s(shard_len, g);
        let new = rand.updated(&old);
        let mut slab = vec![0u8; layout.byte_len()];
        let rng = rand.stream(z, Stage::Weight);
        weight::encode_shard(
            layout,
            encoding,
            plan.padded_index(z, 0),
            &new,
            &old,
            &rng,
            &mut slab,
        );
        recv.extend(slab);
    }
    let own_reference = rand.bf16s(shard_len, g);
    let params = rand.bf16s(plan.numel, g);
    let cpu = |recv: &[u8]| {
        let mut out = params.clone();
        weight::apply_shards(layout, encoding, &plan, me, recv, &own_reference, &mut out)
            .expect("valid slabs");
        bf16_bytes(&out)
    };
    let own = difference.then(|| case.input(bf16_bytes(&own_reference)));
    let (bad, twin) = damage(rand, layout, &recv);
    for (tag, input, want) in [("", &recv, cpu(&recv)), (" damaged", &bad, cpu(&twin))] {
        let input = case.input(input.clone());
        let out = case.output(
            bf16_bytes(&params),
            format!("weight_apply{tag}"),
            Expect::Bf16,
            want,
        );
        case.launch(
            Kernel::WeightApply,
            (w * shard_len.div_ceil(g)) as u64,
            GROUPS_PER_BLOCK,
            &[Some(input), own, Some(out)],
            &SdpWeightApply::new(&layout, encoding, &plan, me).expect("params"),
        );
    }
    case
}

#[derive(Debug, Clone, Copy)]
enum GlobalData {
    /// Finite values, including denormals, zeros and values near `f32::MAX`.
    Plain,
    /// With NaN and Inf (the absmax flags them; the rounding still runs at some scale).
    Specials,
    /// All zeros: the scale is 0, so every `x / s` is NaN.
    Zeros,
}

/// Integer codes Global-QSGD sums, with their kernels.
trait WireInt: IntCode + Default {
    const QUANTIZE: Kernel;
    const DEQUANTIZE: Kernel;
    fn random(rand: &mut Gen) -> Self;
    fn le_bytes(values: &[Self]) -> Vec<u8>;
}

impl WireInt for i8 {
    const QUANTIZE: Kernel = Kernel::GlobalQuantizeI8;
    const DEQUANTIZE: Kernel = Kernel::GlobalDequantizeI8;
    fn random(rand: &mut Gen) -> Self {
        rand.word() as i8
    }
    fn le_bytes(values: &[Self]) -> Vec<u8> {
        values.iter().map(|&v| v as u8).collect()
    }
}

impl WireInt for i16 {
    const QUANTIZE: Kernel = Kernel::GlobalQuantizeI16;
    const DEQUANTIZE: Kernel = Kernel::GlobalDequantizeI16;
    fn random(rand: &mut Gen) -> Self {
        rand.word() as i16
    }
    fn le_bytes(values: &[Self]) -> Vec<u8> {
        values.iter().flat_map(|v| v.to_le_bytes()).collect()
    }
}

/// Global-QSGD over one bucket: the absmax, then for int8 and int16 at two world sizes the
/// rounding (stochastic and nearest) at the scale the collective would use, and the
/// dequantization of random sums.
fn global_case(rand: &mut Gen, numel: usize, data: GlobalData) -> Case {
    let mut case = Case::new(format!("global-qsgd n={numel} {data:?}"), rand);
    let mut bucket = rand.values(numel, 64);
    match data {
        GlobalData::Plain => bucket
            .iter_mut()
            .filter(|x| !x.is_finite())
            .for_each(|x| *x = 0.5),
        GlobalData::Specials => {}
        GlobalData::Zeros => bucket.fill(0.0),
    }
    let absmax = global_qsgd::local_absmax(&bucket);
    let input = case.input(f32_bytes(&bucket));
    let bits = case.output(
        vec![0; 4],
        "global_absmax".into(),
        Expect::AbsmaxBits,
        absmax.to_bits().to_le_bytes().to_vec(),
    );
    case.launch(
        Kernel::GlobalAbsmax,
        numel as u64,
        ELEMENTS_PER_BLOCK,
        &[Some(input), Some(bits)],
        &SdpGlobal::absmax(numel),
    );
    global_codes::<i8>(&mut case, rand, input, &bucket, absmax, 2);
    global_codes::<i8>(&mut case, rand, input, &bucket, absmax, 127);
    global_codes::<i16>(&mut case, rand, input, &bucket, absmax, 3);
    global_codes::<i16>(&mut case, rand, input, &bucket, absmax, 1000);
    case
}

fn global_codes<T: WireInt>(
    case: &mut Case,
    rand: &mut Gen,
    input: Buf,
    bucket: &[f32],
    absmax: f32,
    w: usize,
) {
    let numel = bucket.len();
    let k = global_k(T::BITS, w);
    // A non-finite absmax never reaches the rounding in the collective; any scale still
    // exercises NaN / Inf inputs here.
    let scale = if absmax.is_finite() {
        absmax / k as f32
    } else {
        0.37
    };
    let width = size_of::<T>();
    for rounding in [Rounding::Stochastic, Rounding::Nearest] {
        let rng = rand.stream(0, Stage::GlobalQsgd);
        let mut want = vec![T::default(); numel];
        global_qsgd::quantize(bucket, scale, k, rounding, &rng, &mut want);
        let out = case.output(
            garbage(numel * width),
            format!("{} W={w} {rounding:?}", T::QUANTIZE.name()),
            Expect::Ints(width),
            T::le_bytes(&want),
        );
        case.launch(
            T::QUANTIZE,
            numel as u64,
            ELEMENTS_PER_BLOCK,
            &[Some(input), Some(out)],
            &SdpGlobal::quantize(numel, scale, k, rounding, &rng),
        );
    }
    let sums: Vec<T> = (0..numel).map(|_| T::random(rand)).collect();
    let mut want = vec![0f32; numel];
    global_qsgd::dequantize(&sums, scale, &mut want);
    let sums = case.input(T::le_bytes(&sums));
    let out = case.output(
        garbage(4 * numel),
        format!("{} W={w}", T::DEQUANTIZE.name()),
        Expect::F32,
        f32_bytes(&want),
    );
    case.launch(
        T::DEQUANTIZE,
        numel as u64,
        ELEMENTS_PER_BLOCK,
        &[Some(sums), Some(out)],
        &SdpGlobal::dequantize(numel, scale),
    );
}

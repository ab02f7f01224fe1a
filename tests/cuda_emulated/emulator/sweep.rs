//! Runs one family of cases through the emulator and reports every output that differs from
//! the CPU backend's, naming the family, the case and the first difference.

use std::collections::BTreeSet;
use std::fs::File;
use std::io::ErrorKind;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus};
use std::time::{Duration, Instant};

use sdp4bit::backend::cuda::source::Kernel;

use super::case::Case;
use super::compile::{emulator_executable, require_gxx};
use sdp4bit_test_support::host_kernels;
use sdp4bit_test_support::random::SplitMix64;

/// The data seed unless `SDP4BIT_TEST_SEED` is set.
const DEFAULT_SEED: u64 = 0x5D94_B17E_0000_0001;

/// How long the emulator may run one family (the largest, TLq-HS's full sweep, takes about
/// 30 s on two cores).
const EMULATOR_TIMEOUT: Duration = Duration::from_secs(600);

/// How much of a family's cross product of variants and sizes runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Coverage {
    /// Every case (`SDP4BIT_EMULATOR_FULL=1`, as the test command sets).
    Full,
    /// About a third of the cases, still covering every axis.
    Subset,
}

/// Whether the environment variable `name` is `1`.
fn flag(name: &str) -> bool {
    std::env::var(name).is_ok_and(|v| v == "1")
}

/// Emulates the cases `make_cases` draws for `family` and compares every output with the CPU
/// backend's; panics with every difference (the first 25 listed), or when the cases do not
/// launch each kernel whose parameter struct is one of `structs` (by the kernel table).
///
/// Environment: `SDP4BIT_SKIP_EMULATOR=1` skips (printing `skipped: ...`);
/// `SDP4BIT_EMULATOR_FULL=1` asks for [`Coverage::Full`]; `SDP4BIT_KERNELS_DIR=DIR` emulates
/// the kernel sources in DIR instead of `kernels/`; `SDP4BIT_TEST_SEED=N` changes the data
/// seed (each family draws from the seed and its own name). g++ is required otherwise. The
/// family's work directory (case files, outputs, the emulator) is removed when the family
/// passes and kept, its path printed, when it fails.
pub fn emulate_family(
    family: &str,
    structs: &[&str],
    make_cases: impl FnOnce(&mut SplitMix64, Coverage) -> Vec<Case>,
) {
    if flag("SDP4BIT_SKIP_EMULATOR") {
        println!("skipped: SDP4BIT_SKIP_EMULATOR=1");
        return;
    }
    let coverage = if flag("SDP4BIT_EMULATOR_FULL") {
        Coverage::Full
    } else {
        Coverage::Subset
    };
    let seed = std::env::var("SDP4BIT_TEST_SEED")
        .ok()
        .map(|s| s.parse().expect("SDP4BIT_TEST_SEED is a u64"))
        .unwrap_or(DEFAULT_SEED);
    let kernel_dir = std::env::var_os("SDP4BIT_KERNELS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels"));
    require_gxx();
    let start = Instant::now();

    // g++ builds (or another family's test already built) while the CPU backend computes the
    // cases.
    let (executable, cases) = std::thread::scope(|s| {
        let build = s.spawn(|| emulator_executable(&kernel_dir));
        let cases = make_cases(&mut SplitMix64::derive(seed, name_tag(family)), coverage);
        let executable = build
            .join()
            .unwrap_or_else(|e| std::panic::resume_unwind(e));
        (executable, cases)
    });
    let executable = executable.unwrap_or_else(|e| panic!("{family}: {e}"));
    let launched: BTreeSet<&str> = cases
        .iter()
        .flat_map(|c| c.specs().map(|s| s.kernel.name()))
        .collect();
    let kernels = Kernel::ALL
        .into_iter()
        .filter(|k| structs.contains(&k.params()));
    for kernel in kernels {
        assert!(
            launched.contains(kernel.name()),
            "{family}: no case launches {}",
            kernel.name()
        );
    }
    let work = WorkDir::create(family);
    let emulator = work.path().join("emulator");
    write_executable(&emulator, executable);
    // The host builds of every specialisation the cases launch, which the emulator loads.
    let specs: Vec<_> = cases.iter().flat_map(Case::specs).collect();
    host_kernels::build(&specs, &kernel_dir, work.path(), "kernels")
        .unwrap_or_else(|e| panic!("{family}: {e}"));
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
        checks += case.checks();
        let Ok(out) = std::fs::read(work.path().join(format!("{i:04}.out"))) else {
            missing += 1;
            continue;
        };
        failures.extend(
            case.compare(&out)
                .into_iter()
                .map(|e| format!("case {i:04} ({}): {e}", case.name())),
        );
    }
    if missing > 0 {
        failures.push(format!(
            "{missing} cases have no output (see the emulator's errors)"
        ));
    }
    let launches: usize = cases.iter().map(|c| c.specs().count()).sum();
    let distinct: BTreeSet<String> = specs.iter().map(|s| s.entry()).collect();
    println!(
        "{family}: {} cases ({coverage:?}), {launches} launches of {} specialisations, \
         {checks} outputs compared, seed {seed:#x}, {jobs} emulator threads; g++ builds and \
         case generation {:.1} s, emulation {:.1} s",
        cases.len(),
        distinct.len(),
        built.as_secs_f64(),
        (emulated - built).as_secs_f64()
    );
    if !failures.is_empty() {
        let shown = failures.len().min(25);
        panic!(
            "{family}: the emulated kernels do not match the CPU backend (seed {seed:#x}, \
             kernels from {}, {checks} outputs checked); {} problems, the first {shown}:\n{}",
            kernel_dir.display(),
            failures.len(),
            failures[..shown].join("\n")
        );
    }
}

/// A 64-bit tag of `name` (FNV-1a), so each family draws its own data from the seed.
fn name_tag(name: &str) -> u64 {
    name.bytes().fold(0xCBF2_9CE4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01B3)
    })
}

/// Writes the emulator's bytes to `path`, executable.
fn write_executable(path: &Path, bytes: &[u8]) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::write(path, bytes).expect("write the emulator executable");
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755))
        .expect("make the emulator executable");
}

/// Starts `command`, retrying while the executable is busy: a process forked by another test
/// thread while this one was writing the executable keeps a write handle to it until it execs
/// (ETXTBSY), for a few milliseconds at most.
fn spawn_retrying(command: &mut Command) -> Child {
    let mut attempts = 0;
    loop {
        match command.spawn() {
            Err(e) if e.kind() == ErrorKind::ExecutableFileBusy && attempts < 200 => {
                attempts += 1;
                std::thread::sleep(Duration::from_millis(5));
            }
            started => return started.expect("start the emulator"),
        }
    }
}

/// Runs the emulator over the case files in `dir` with `jobs` threads; returns its exit status
/// and its stderr (both streams go to files in `dir`). Kills it and fails after
/// [`EMULATOR_TIMEOUT`]: a kernel that never returns would otherwise hang the test.
fn run_emulator(exe: &Path, dir: &Path, jobs: usize) -> (ExitStatus, String) {
    let log = |name: &str| File::create(dir.join(name)).expect("create an emulator log file");
    let mut child = spawn_retrying(
        Command::new(exe)
            .arg(dir)
            .arg(jobs.to_string())
            .stdout(log("emulator.stdout"))
            .stderr(log("emulator.stderr")),
    );
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
            out += &format!(" ({})", case.name());
        }
        rest = &tail[digits..];
    }
    out + rest
}

/// A fresh directory for one family's emulator, case files and outputs; removed when the test
/// passes, kept (and named on stderr) when it fails.
struct WorkDir(PathBuf);

impl WorkDir {
    fn create(family: &str) -> Self {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let slug: String = family
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() {
                    c.to_ascii_lowercase()
                } else {
                    '-'
                }
            })
            .collect();
        let dir = std::env::temp_dir().join(format!(
            "sdp4bit-emulated-{slug}-{}-{nanos}",
            std::process::id()
        ));
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

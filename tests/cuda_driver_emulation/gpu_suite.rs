//! The GPU test suites, unchanged, against the emulation: each test binary (built by the same
//! `cargo test`, beside this one) runs in a child process whose `LD_LIBRARY_PATH` starts with
//! the directory of the emulated `libcuda.so`, with `SDP4BIT_REQUIRE_GPU=1` so that a skip
//! fails. Run on their own, `cargo test --test cuda_gpu` and `--test cuda_gpu_collectives`
//! still see no driver and skip.

use std::path::PathBuf;
use std::process::Command;

use super::library::emulation;

/// The newest `<suite>-<hash>` test executable beside this one.
fn suite_executable(suite: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("the test executable");
    let dir = exe.parent().expect("the deps directory");
    let prefix = format!("{suite}-");
    let mut found: Vec<(std::time::SystemTime, PathBuf)> = std::fs::read_dir(dir)
        .expect("read the deps directory")
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        .filter(|path| {
            let name = path.file_name().map(|n| n.to_string_lossy().into_owned());
            name.is_some_and(|n| n.starts_with(&prefix) && !n.contains('.'))
        })
        .filter_map(|path| Some((path.metadata().ok()?.modified().ok()?, path)))
        .collect();
    found.sort();
    let Some((_, newest)) = found.pop() else {
        panic!(
            "no {suite} test executable in {}: run the whole `cargo test` (or `cargo test \
             --release --test {suite} --no-run` first)",
            dir.display()
        );
    };
    newest
}

/// Runs the test binary of `suite` on the emulation with `env` besides the driver's search
/// path and `SDP4BIT_REQUIRE_GPU=1`, and checks that every test ran and passed.
fn run_on_the_emulation(suite: &str, env: &[(&str, &str)]) {
    let suite = suite_executable(suite);
    let library_dir = emulation()
        .path()
        .parent()
        .expect("the library's directory");
    let path = match std::env::var_os("LD_LIBRARY_PATH") {
        Some(old) => format!("{}:{}", library_dir.display(), old.to_string_lossy()),
        None => library_dir.display().to_string(),
    };
    let output = Command::new(&suite)
        .env("LD_LIBRARY_PATH", path)
        .env("SDP4BIT_REQUIRE_GPU", "1")
        .envs(env.iter().copied())
        .output()
        .expect("run the test suite");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    println!("{}: {}\n{stdout}\n{stderr}", suite.display(), output.status);
    assert!(
        output.status.success(),
        "{} failed on the emulation",
        suite.display()
    );
    assert!(
        stderr.contains("cuda-driver-emulation: "),
        "the suite did not load the emulation"
    );
    assert!(!stdout.contains("skipped: "), "a test skipped: {stdout}");
    assert!(stdout.contains("test result: ok"), "{stdout}");
}

#[test]
fn gpu_suite_runs_on_the_emulation() {
    run_on_the_emulation("cuda_gpu", &[]);
}

/// The quick sweep: the emulation runs the kernels as host code.
#[test]
fn gpu_collectives_run_on_the_emulation() {
    run_on_the_emulation("cuda_gpu_collectives", &[("SDP4BIT_GPU_TEST_QUICK", "1")]);
}

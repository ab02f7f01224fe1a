//! `tests/cuda_gpu.rs`, unchanged, against the emulation: its test binary (built by the same
//! `cargo test`, beside this one) runs in a child process whose `LD_LIBRARY_PATH` starts with
//! the directory of the emulated `libcuda.so`, with `SDP4BIT_REQUIRE_GPU=1` so that a skip
//! fails. Run on its own, `cargo test --test cuda_gpu` still sees no driver and skips.

use std::path::PathBuf;
use std::process::Command;

use super::library::emulation;

/// The newest `cuda_gpu-<hash>` test executable beside this one.
fn gpu_suite_executable() -> PathBuf {
    let exe = std::env::current_exe().expect("the test executable");
    let dir = exe.parent().expect("the deps directory");
    let mut found: Vec<(std::time::SystemTime, PathBuf)> = std::fs::read_dir(dir)
        .expect("read the deps directory")
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        .filter(|path| {
            let name = path.file_name().map(|n| n.to_string_lossy().into_owned());
            name.is_some_and(|n| n.starts_with("cuda_gpu-") && !n.contains('.'))
        })
        .filter_map(|path| Some((path.metadata().ok()?.modified().ok()?, path)))
        .collect();
    found.sort();
    let Some((_, newest)) = found.pop() else {
        panic!(
            "no cuda_gpu test executable in {}: run the whole `cargo test` (or `cargo test \
             --release --test cuda_gpu --no-run` first)",
            dir.display()
        );
    };
    newest
}

#[test]
fn gpu_suite_runs_on_the_emulation() {
    let suite = gpu_suite_executable();
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
        .output()
        .expect("run the cuda_gpu suite");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    println!("{}: {}\n{stdout}\n{stderr}", suite.display(), output.status);
    assert!(
        output.status.success(),
        "the cuda_gpu suite failed on the emulation"
    );
    assert!(
        stderr.contains("cuda-driver-emulation: "),
        "the suite did not load the emulation"
    );
    assert!(
        !stdout.contains("skipped: the CUDA"),
        "a test skipped: {stdout}"
    );
    assert!(stdout.contains("test result: ok"), "{stdout}");
}

//! The torch extension's stream order for CUDA collectives (`cpp/stream_order.h`, the template
//! `cpp/sdp4bit_ops.cpp` instantiates over torch's c10 streams and events) on a model of a
//! device: g++ builds `tests/stream_order/model.cpp` with the header unchanged, and the model
//! runs a training step's use of a collective in many stream interleavings (a gradient
//! reduce-scatter, a weight all-gather, a pipelined reduce-scatter whose chunks' exchanges
//! run on the communicator's stream while the side stream computes, its bucket re-created
//! while it may still run, and FSDP2's backward: an all-gather started while a reduce-scatter
//! runs, each on the side stream `SideStreams` gives its kind). It must find no unordered
//! memory access, no wait of the caller's stream on the collective before `wait()`, no pass
//! that should overlap an exchange ordered after it and nothing of the all-gather waiting for
//! the reduce-scatter, and must find the fault when any one step of the order is left out or
//! both kinds share one side stream (so the check can fail); `SideStreams` is also checked
//! directly. g++ is required.

use std::path::Path;
use std::process::Command;

#[test]
fn stream_order_holds_on_the_device_model() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let binary = Path::new(env!("CARGO_TARGET_TMPDIR")).join("stream_order_model");
    let build = Command::new("g++")
        .args(["-std=c++17", "-O2", "-Wall", "-Wextra", "-Werror", "-I"])
        .arg(root.join("cpp"))
        .arg(root.join("tests/stream_order/model.cpp"))
        .arg("-o")
        .arg(&binary)
        .output()
        .expect("start g++ (needed to build the stream-order model)");
    assert!(
        build.status.success(),
        "g++ failed on tests/stream_order/model.cpp:\n{}",
        String::from_utf8_lossy(&build.stderr)
    );
    let run = Command::new(&binary)
        .args(["2000", "24301"])
        .output()
        .expect("run the stream-order model");
    let report = String::from_utf8_lossy(&run.stdout);
    println!("{report}");
    assert!(
        run.status.success(),
        "the stream-order model failed:\n{report}"
    );
    // The order itself, each of the nine sabotaged orders and SideStreams were checked.
    assert_eq!(
        report.lines().filter(|l| l.starts_with("ok ")).count(),
        11,
        "{report}"
    );
}

//! Scenarios that need a process of their own (a fault that stops the process or stays in the
//! fault log, an emulated device or driver configured differently, a search path without
//! NVRTC): the test runs this test binary again for itself alone, with `CHILD` naming it and
//! the built emulation handed over, and checks the child's exit status and output; the child
//! runs the scenario and checks what it sees.

use std::process::{Command, Output};

use super::library::{LIBRARY_VAR, emulation};

/// The variable naming the test a child process runs.
const CHILD: &str = "SDP4BIT_EMULATION_FAULT";

/// In the child (`CHILD` = `test`, a full test path such as `faults::name`): runs `scenario`
/// and returns `None`. In the parent: runs the child with `env` (a value of `None` removes the
/// variable) and returns its output, printed.
pub fn run_isolated(
    test: &str,
    env: &[(&str, Option<&str>)],
    scenario: impl FnOnce(),
) -> Option<Output> {
    if std::env::var(CHILD).is_ok_and(|v| v == test) {
        scenario();
        return None;
    }
    let exe = std::env::current_exe().expect("the test executable");
    let mut command = Command::new(exe);
    command
        .args([test, "--exact", "--nocapture"])
        .env(CHILD, test)
        .env(LIBRARY_VAR, emulation().path());
    for (name, value) in env {
        match value {
            Some(value) => command.env(name, value),
            None => command.env_remove(name),
        };
    }
    let output = command.output().expect("run the child test process");
    println!(
        "child {test}: {}\n--- stdout\n{}\n--- stderr\n{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    Some(output)
}

/// Checks that the child passed (its own assertions held) and ran one test.
pub fn assert_child_passed(output: &Output) {
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "the child failed: {}",
        output.status
    );
    assert!(
        stdout.contains("1 passed"),
        "the child ran no test:\n{stdout}"
    );
}

"""python -m sdp4bit.selftest: on a host without a GPU (this one, or any host with
CUDA_VISIBLE_DEVICES empty) it reports the versions and which extension loaded from where, says
that nothing was checked and exits with status 2; its report and check runner, with outcomes
of every kind."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from sdp4bit import selftest

ROOT = Path(__file__).resolve().parents[2]


def test_without_a_gpu_it_says_so_and_exits_non_zero():
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    done = subprocess.run([sys.executable, "-m", "sdp4bit.selftest", "--no-bench"], cwd="/tmp",
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == selftest.EXIT_NO_GPU == 2, done.stdout + done.stderr
    report = done.stdout
    for needle in ["sdp4bit selftest report", "torch", "CUDA driver", "NVRTC",
                   "GPUs", "none visible to torch", "(none ran)",
                   "result: no CUDA GPU is visible to torch on this host: nothing was checked"]:
        assert needle in report, f"{needle!r} not in:\n{report}"
    import torch
    assert torch.__version__ in report
    # Which extension loaded, and from where.
    loaded = re.search(r"^extension\s+(built at install|compiled at first import): (\S+)$",
                       report, re.M)
    assert loaded and Path(loaded.group(2)).is_file(), report


def test_report_shows_every_outcome_and_the_failure_output():
    outcomes = [
        selftest.Outcome("kernels against the host on GPU 0", "PASS", 1.25, "all equal"),
        selftest.Outcome("cargo test --release --test cuda_gpu", "FAIL", 3.0,
                         "`cargo test` exited with 101:\nthread panicked at cuda_gpu.rs:12"),
        selftest.Outcome("cargo bench --bench gpu", "SKIP", 0.0, "--no-bench"),
    ]
    text = selftest.format_report([("torch", "2.9.1"), ("CUDA driver", "13.0")], outcomes,
                                  "1 passed, 1 failed, 1 skipped")
    assert "torch        2.9.1" in text
    assert "  PASS  kernels against the host on GPU 0 (1.2 s)" in text
    assert "  FAIL  cargo test --release --test cuda_gpu (3.0 s)" in text
    assert "        | thread panicked at cuda_gpu.rs:12" in text
    assert "  SKIP  cargo bench --bench gpu (0.0 s)" in text
    assert text.endswith("result: 1 passed, 1 failed, 1 skipped")


def test_run_check_maps_results_skips_and_exceptions():
    passed = selftest.run_check("ok", lambda: "fine")
    assert (passed.status, passed.detail) == ("PASS", "fine")

    def skipped():
        raise selftest.Skipped("needs the source tree")

    def failed():
        raise RuntimeError("kernel grad_reduce_final differs at byte 3")

    assert selftest.run_check("s", skipped).status == "SKIP"
    failure = selftest.run_check("f", failed)
    assert failure.status == "FAIL"
    assert failure.detail == "RuntimeError: kernel grad_reduce_final differs at byte 3"


def test_failed_command_reports_its_exit_status_and_output_tail(tmp_path):
    with pytest.raises(RuntimeError, match=r"exited with 3:\nlast words"):
        selftest._command([sys.executable, "-c", "print('last words'); raise SystemExit(3)"],
                          tmp_path, dict(os.environ), 60)
    assert selftest._command([sys.executable, "-c", "print('done')"], tmp_path,
                             dict(os.environ), 60) == "done"


def test_source_tree_is_found_only_where_the_gpu_suites_are(tmp_path):
    assert selftest.find_source(str(ROOT)) == ROOT.resolve()
    assert selftest.find_source(str(tmp_path)) is None


def test_gpu_ops_report_a_missing_driver():
    """The ops the selftest calls on a GPU host answer on a host without a driver too: the
    report says why the device cannot run the kernels, the kernel check raises naming it."""
    import torch
    if torch.cuda.is_available():
        pytest.skip("this host has a GPU: the selftest itself exercises these ops")
    report = torch.ops.sdp4bit.cuda_device_report(0)
    assert report.startswith("CUDA device 0 cannot run the kernels:"), report
    assert "libcuda" in report, report
    with pytest.raises(RuntimeError, match="libcuda"):
        torch.ops.sdp4bit.cuda_kernel_check(0, "sdp4bit", [0, 0, 1, 1], 1)
    with pytest.raises(RuntimeError, match="rank 4 outside the 4-rank DP group"):
        torch.ops.sdp4bit.cuda_kernel_check(0, "sdp4bit", [0, 0, 1, 1], 4)

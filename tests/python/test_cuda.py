"""The collectives on CUDA tensors (the Rust core's CUDA backend: kernels on torch's current
stream, exchanges over NCCL or gloo) against the in-process CPU collective, byte for byte.
Needs a CUDA GPU; skipped without one (the CPU-only checks of CUDA set-up errors are in
test_collectives.py)."""

import cuda_scenarios
import pytest
import scenarios
import torch
from harness import run_ranks

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_w1_nccl_equals_the_cpu():
    run_ranks(1, scenarios.byte_equal_to_in_process, [0], scenarios.PRESETS, False, "cuda:0",
              backend="nccl")


@pytest.mark.parametrize("labels", [[0, 0], [0, 1]], ids=["1x2", "2x1"])
def test_w2_gloo_on_one_gpu_equals_the_cpu(labels):
    run_ranks(2, scenarios.byte_equal_to_in_process, labels, scenarios.PRESETS, False,
              "cuda:0")


def test_w4_gloo_on_one_gpu_two_levels_equal_the_cpu():
    run_ranks(4, scenarios.byte_equal_to_in_process, [0, 0, 1, 1], scenarios.PRESETS, False,
              "cuda:0")


def test_pipelined_chunks_on_one_gpu_equal_one_chunk():
    reports = run_ranks(4, scenarios.pipelined_chunks_equal_one_chunk, [0, 0, 1, 1], "cuda:0")
    assert reports[0] == ["4", "3", "auto"], reports[0]


def test_nan_reaches_every_owner_on_cuda():
    run_ranks(2, scenarios.nan_reaches_the_owner, [0, 1], scenarios.PRESETS, "cuda:0")


def test_stream_behaviour_measured_with_events():
    """On the GPU, with long kernels queued: start() does not wait for the compute stream, the
    compute stream runs on while the exchange is pending, and wait() orders the compute stream
    after the exchange without blocking the host (cuda_scenarios._measure). Prints the
    measurements as `stream-evidence:` lines for the GPU kit's report."""
    [report] = run_ranks(1, cuda_scenarios.stream_behaviour, "cuda:0", backend="nccl")
    long = cuda_scenarios.LONG_MS
    for collective, m in report.items():
        print(f"stream-evidence: {collective}: start() {m['start_ms']:.2f} ms on the host with "
              f"{long:.0f} ms queued on the compute stream (exchange pending after it: "
              f"{m['pending_after_start']}); compute-stream event done {m['compute_free_ms']:.2f}"
              f" ms after start() while the exchange waited behind {long:.0f} ms on the side "
              f"stream (still pending: {m['pending_when_compute_free']}); wait() "
              f"{m['wait_ms']:.2f} ms on the host (pending after it: {m['pending_after_wait']});"
              f" the compute stream resumed {m['resumed_after_ms']:+.3f} ms after the side "
              f"stream's end, an event recorded before wait() {m['control_before_ms']:+.1f} ms")
        host = cuda_scenarios.HOST_CALL_MS
        assert m["start_ms"] < host and m["pending_after_start"], (collective, m)
        assert m["compute_free_ms"] < host and m["pending_when_compute_free"], (collective, m)
        assert m["wait_ms"] < host and m["pending_after_wait"], (collective, m)
        assert m["resumed_after_ms"] > -1.0, (collective, m)
        assert m["control_before_ms"] < -0.5 * long, (collective, m)

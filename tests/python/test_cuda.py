"""The collectives on CUDA tensors (the Rust core's CUDA backend: kernels on torch's current
stream, exchanges over NCCL or gloo) against the in-process CPU collective, byte for byte.
Needs a CUDA GPU; skipped without one (the CPU-only checks of CUDA set-up errors are in
test_collectives.py)."""

import cuda_scenarios
import integer_sum_scenarios
import pytest
import replica_scenarios
import scenarios
import torch
from harness import run_ranks

from sdp4bit import replicas

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


def test_all_gather_runs_while_a_reduce_scatter_is_pending():
    """FSDP2's backward: with the reduce-scatter's side stream busy for LONG_MS, an all-gather
    started after it completes at once on its own side stream, while the reduce-scatter is
    still pending (cuda_scenarios.all_gather_beside_reduce_scatter). Prints the measurements
    as a `stream-evidence:` line for the GPU kit's report."""
    [m] = run_ranks(1, cuda_scenarios.all_gather_beside_reduce_scatter, "cuda:0",
                    backend="nccl")
    long = cuda_scenarios.LONG_MS
    print(f"stream-evidence: all-gather beside a reduce-scatter: side streams distinct: "
          f"{m['distinct']}; with {long:.0f} ms queued on the reduce-scatter's side stream, the "
          f"all-gather took {m['all_gather_ms']:.2f} ms from start() to the compute stream "
          f"passing its wait() (reduce-scatter still pending: {m['reduce_scatter_pending']}), "
          f"{m['lead_ms']:.1f} ms before the reduce-scatter's side stream reached its end; "
          f"with {long:.0f} ms on the all-gather's own side stream instead: "
          f"{m['control_ms']:.1f} ms")
    assert m["distinct"], m
    host = cuda_scenarios.HOST_CALL_MS
    assert m["all_gather_ms"] < host and m["reduce_scatter_pending"], m
    assert m["lead_ms"] > 0.5 * long, m
    assert m["control_ms"] > 0.5 * long, m


def test_side_streams_are_sdp4bit_s_own_at_the_greatest_priority():
    """The side streams are none of the streams torch's pools hand out (where ProcessGroupNCCL
    takes its own), one per kind, at one priority no lower than any torch stream's, FSDP2's
    high-priority ones included, and collectives run on them
    (cuda_scenarios.side_streams_of_their_own)."""
    [m] = run_ranks(1, cuda_scenarios.side_streams_of_their_own, "cuda:0", backend="nccl")
    assert not m["in_pool"] and m["distinct"], m
    first, second = m["priorities"]
    assert first == second <= m["torch_greatest"] < 0, m


def test_graph_capture_is_refused_by_start_and_set_up():
    """start() of both collectives and a bucket's set-up inside torch.cuda.graph raise an
    error naming the capture, enqueuing nothing into it; the buckets work outside it."""
    [errors] = run_ranks(1, cuda_scenarios.graph_capture_refused, "cuda:0")
    assert len(errors) == 3, errors
    for error in errors:
        assert "a CUDA graph is being captured on the current stream of cuda:0" in error, error


def test_integer_sum_overflows_raise_on_every_cuda_rank_at_the_same_start():
    """A CUDA Global-QSGD bucket agrees on its overflows itself (its own readback, injected
    overflows on top): every rank raises the same errors at the same starts, never from
    wait(), and no rank enqueued those steps (integer_sum_scenarios.overflows_raise_at_once,
    4 gloo ranks on one GPU)."""
    for raised, shard_len, own in run_ranks(4, integer_sum_scenarios.overflows_raise_at_once,
                                            "cuda:0"):
        assert own, "a CUDA Global-QSGD bucket reads its integer sums back"
        assert raised == integer_sum_scenarios.expected_raises(shard_len), raised


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_buckets_on_another_device_than_the_one_current_at_set_up():
    """Groups made and buckets set up with cuda:0 current on both ranks, the buckets on
    cuda:<rank>, over NCCL: the set-up agreement runs on the executor with each bucket's device
    current (with cuda:0 on both ranks NCCL would refuse one GPU for two ranks), and both
    collectives equal the in-process ones (cuda_scenarios.buckets_beside_the_groups_device)."""
    assert run_ranks(2, cuda_scenarios.buckets_beside_the_groups_device, backend="nccl") == [0, 0]


def test_the_check_takes_one_chunk_of_device_memory():
    """The set-up's replica check (test_replicas.py) on a CUDA bucket of 128 MiB (NCCL,
    W = 1): the peak of torch's CUDA allocator stays within the two chunk tensors (and 1 MiB of
    sums), the whole bucket as one chunk exceeds it."""
    numel = 64 << 20
    [bounded] = run_ranks(1, replica_scenarios.check_memory, numel, replicas.CHUNK, "cuda:0",
                          backend="nccl")
    [whole] = run_ranks(1, replica_scenarios.check_memory, numel, numel, "cuda:0",
                        backend="nccl")
    print(f"replica check of a CUDA bucket of {numel} params: peak {bounded / 2**20} MiB in "
          f"chunks of {replicas.CHUNK}, {whole / 2**20} MiB as one chunk")
    assert 0 < bounded <= 16 * replicas.CHUNK + (1 << 20), bounded
    assert whole > 12 * numel, whole

"""Scenarios that need a CUDA GPU (test_cuda.py runs them in rank processes): the stream
behaviour of CUDA buckets, measured with CUDA events and host clocks."""

from __future__ import annotations

import time

import torch

from sdp4bit import Config, GradReduceScatter, ProcessGroups, WeightAllGather

#: How long the long kernels queued on a stream spin, milliseconds.
LONG_MS = 200.0
#: Longest a call that only enqueues may take on the host, milliseconds (a launch or an event
#: takes microseconds; this leaves room for a slow host without admitting a LONG_MS wait).
HOST_CALL_MS = 50.0


def _cycles_per_ms() -> float:
    """The GPU clock as torch.cuda._sleep counts it, measured with CUDA events after a spin
    that brings the clock up (an idle H100 measured at its idle clock spun about half as long
    as asked later)."""
    torch.cuda._sleep(200_000_000)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cycles = 100_000_000
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return cycles / start.elapsed_time(end)


def _poll_until(done, limit_s: float = 5.0) -> float:
    """Milliseconds until ``done()`` is true, polling the host clock."""
    start = time.perf_counter()
    while not done():
        if time.perf_counter() - start > limit_s:
            raise AssertionError("the condition did not come true within 5 s")
    return (time.perf_counter() - start) * 1e3


def _measure(start_collective, side: torch.cuda.Stream, cycles_per_ms: float) -> dict:
    """The three properties of a CUDA bucket's collective, each with a long kernel on the
    stream that would expose a wait:

    - ``start_ms``: host time of start() while a LONG_MS kernel runs on the compute stream,
      which the exchange must follow; ``pending_after_start``: the exchange has not run yet.
    - ``compute_free_ms``: with the side stream busy for LONG_MS before the exchange, host time
      until an event recorded on the compute stream after start() completes;
      ``pending_when_compute_free``: the exchange was still pending then.
    - ``wait_ms``: host time of wait() while the exchange is pending; ``resumed_after_ms``:
      how long after the side stream's end (an event recorded on it after start()) an event
      recorded on the compute stream after wait() completed, >= 0 when wait() ordered the
      compute stream after the exchange; ``control_before_ms``: the same for an event recorded
      before wait(), negative (it ran while the exchange waited), which shows the measure can
      see a stream that was not ordered.
    """
    long = int(LONG_MS * cycles_per_ms)
    timed = {"enable_timing": True}
    out = {}

    torch.cuda._sleep(long)
    t0 = time.perf_counter()
    handle = start_collective()
    out["start_ms"] = (time.perf_counter() - t0) * 1e3
    out["pending_after_start"] = not handle.is_completed()
    handle.wait()
    torch.cuda.synchronize()

    with torch.cuda.stream(side):
        torch.cuda._sleep(long)
    handle = start_collective()
    compute_done = torch.cuda.Event()
    compute_done.record()
    out["compute_free_ms"] = _poll_until(compute_done.query)
    out["pending_when_compute_free"] = not handle.is_completed()
    handle.wait()
    torch.cuda.synchronize()

    with torch.cuda.stream(side):
        torch.cuda._sleep(long)
    handle = start_collective()
    side_done = torch.cuda.Event(**timed)
    side_done.record(side)
    before_wait = torch.cuda.Event(**timed)
    before_wait.record()
    t0 = time.perf_counter()
    handle.wait()
    out["wait_ms"] = (time.perf_counter() - t0) * 1e3
    out["pending_after_wait"] = not handle.is_completed()
    after_wait = torch.cuda.Event(**timed)
    after_wait.record()
    torch.cuda.synchronize()
    out["resumed_after_ms"] = side_done.elapsed_time(after_wait)
    out["control_before_ms"] = side_done.elapsed_time(before_wait)
    return out


def stream_behaviour(rank, world, device):
    """The stream measurements of a gradient and a weight bucket over the process group
    (NCCL at W = 1 on one GPU: the exchange enqueues on the side stream as at any W)."""
    torch.cuda.set_device(device)
    dev = torch.device(device)
    groups = ProcessGroups.create(node_labels=[0] * world)
    config = Config("sdp4bit")
    numel = world * (1 << 20)
    grads = torch.randn(numel, device=dev)
    rs = GradReduceScatter(groups, config, numel, 0, device=dev)
    shard = torch.empty(rs.shard_len, device=dev)
    params = torch.randn(numel, device=dev).to(torch.bfloat16)
    ag = WeightAllGather(groups, config, params, 1)
    # Set-up, the self-check and the first calls happen before anything is timed.
    for step in range(2):
        rs.start(grads, shard, step).wait()
        ag.start(params, step).wait()
    torch.cuda.synchronize()
    side = groups.side_stream(dev)
    cycles = _cycles_per_ms()
    steps = iter(range(2, 100))
    report = {
        "reduce-scatter": _measure(lambda: rs.start(grads, shard, next(steps)), side, cycles),
        "all-gather": _measure(lambda: ag.start(params, next(steps)), side, cycles),
    }
    groups.close()
    return report

"""Scenarios that need a CUDA GPU (test_cuda.py runs them in rank processes): the stream
behaviour of CUDA buckets, measured with CUDA events and host clocks; their side streams; a
CUDA graph capture refused; buckets on another device than the one current at set-up."""

from __future__ import annotations

import time

import scenarios
import torch

from sdp4bit import Config, GradReduceScatter, ProcessGroups, Sdp4bitError, WeightAllGather

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


def _buckets(world: int, dev: torch.device):
    """Groups, a gradient and a weight bucket on `dev` with their tensors, set up and called
    twice (the kernel check and the first calls happen before anything is timed)."""
    groups = ProcessGroups.create(node_labels=[0] * world)
    config = Config("sdp4bit")
    numel = world * (1 << 20)
    grads = torch.randn(numel, device=dev)
    rs = GradReduceScatter(groups, config, numel, 0, device=dev)
    shard = torch.empty(rs.shard_len, device=dev)
    params = torch.randn(numel, device=dev).to(torch.bfloat16)
    ag = WeightAllGather(groups, config, params, 1)
    for step in range(2):
        rs.start(grads, shard, step).wait()
        ag.start(params, step).wait()
    torch.cuda.synchronize()
    return groups, rs, (grads, shard), ag, params


def stream_behaviour(rank, world, device):
    """The stream measurements of a gradient and a weight bucket over the process group
    (NCCL at W = 1 on one GPU: the exchange enqueues on the side stream as at any W), each
    with its own kind's side stream kept busy."""
    torch.cuda.set_device(device)
    dev = torch.device(device)
    groups, rs, (grads, shard), ag, params = _buckets(world, dev)
    cycles = _cycles_per_ms()
    steps = iter(range(2, 100))
    report = {
        "reduce-scatter": _measure(lambda: rs.start(grads, shard, next(steps)),
                                   groups.side_stream(dev, "reduce_scatter"), cycles),
        "all-gather": _measure(lambda: ag.start(params, next(steps)),
                               groups.side_stream(dev, "all_gather"), cycles),
    }
    groups.close()
    return report


def all_gather_beside_reduce_scatter(rank, world, device):
    """FSDP2's backward on one GPU: a reduce-scatter pending behind LONG_MS on its side stream,
    then an all-gather started and waited for on the compute stream.

    - ``distinct``: the two kinds' side streams differ;
    - ``all_gather_ms``: host time from the all-gather's start() until an event recorded on
      the compute stream after its wait() completes; ``reduce_scatter_pending``: the
      reduce-scatter had not completed then;
    - ``lead_ms``: how long before the reduce-scatter's side stream reached its end (an event
      recorded on it after start()) the compute stream's event completed, about LONG_MS when
      the all-gather did not wait for the reduce-scatter;
    - ``control_ms``: ``all_gather_ms`` with the all-gather's own side stream busy for LONG_MS
      instead, about LONG_MS: the measure sees a stream the all-gather waits for.
    """
    torch.cuda.set_device(device)
    dev = torch.device(device)
    groups, rs, (grads, shard), ag, params = _buckets(world, dev)
    rs_side = groups.side_stream(dev, "reduce_scatter")
    ag_side = groups.side_stream(dev, "all_gather")
    long = int(LONG_MS * _cycles_per_ms())
    timed = {"enable_timing": True}
    out = {"distinct": rs_side.cuda_stream != ag_side.cuda_stream}

    def gather(step: int) -> tuple[float, torch.cuda.Event]:
        """Host ms from the all-gather's start() until the compute stream passed its wait(),
        and the event recorded there."""
        t0 = time.perf_counter()
        ag.start(params, step).wait()
        done = torch.cuda.Event(**timed)
        done.record()
        _poll_until(done.query)
        return (time.perf_counter() - t0) * 1e3, done

    with torch.cuda.stream(rs_side):
        torch.cuda._sleep(long)
    reducing = rs.start(grads, shard, 2)
    rs_end = torch.cuda.Event(**timed)
    rs_end.record(rs_side)
    out["all_gather_ms"], gathered = gather(2)
    out["reduce_scatter_pending"] = not reducing.is_completed()
    reducing.wait()
    torch.cuda.synchronize()
    out["lead_ms"] = gathered.elapsed_time(rs_end)

    with torch.cuda.stream(ag_side):
        torch.cuda._sleep(long)
    out["control_ms"], _ = gather(3)
    groups.close()
    return out


def side_streams_of_their_own(rank, world, device):
    """The groups' side streams of both kinds on `device`, after a step of each kind ran on
    them, against 64 streams drawn from each of torch's two pools (32 streams per device and
    priority, handed out round-robin: where ProcessGroupNCCL takes its streams):

    - ``in_pool``: whether a pool stream is one of them; ``distinct``: the two differ;
    - ``priorities``: theirs; ``torch_greatest``: the greatest (numerically lowest) priority
      torch's own streams can have: torch clamps its range (to -3 in torch 2.11), the side
      streams take the device's own greatest from the driver (-5 on an H100).
    """
    torch.cuda.set_device(device)
    dev = torch.device(device)
    groups, *_ = _buckets(world, dev)
    sides = [groups.side_stream(dev, kind).cuda_stream for kind in ("reduce_scatter",
                                                                    "all_gather")]
    pool = {torch.cuda.Stream(device=dev, priority=p).cuda_stream
            for p in (0, -1) for _ in range(64)}
    out = {
        "in_pool": any(s in pool for s in sides),
        "distinct": sides[0] != sides[1],
        "priorities": [groups.side_stream(dev, kind).priority
                       for kind in ("reduce_scatter", "all_gather")],
        "torch_greatest": torch.cuda.Stream.priority_range()[1],
    }
    groups.close()
    return out


def graph_capture_refused(rank, world, device):
    """The errors of a gradient start(), a weight start() and a bucket's set-up made while a
    CUDA graph is captured on the current stream; then both buckets run a step outside it."""
    torch.cuda.set_device(device)
    dev = torch.device(device)
    groups = ProcessGroups.create(node_labels=[0] * world)
    config = Config("sdp4bit")
    numel = world * 4096
    rs = GradReduceScatter(groups, config, numel, 0, device=dev)
    grads = torch.randn(numel, device=dev)
    shard = torch.empty(rs.shard_len, device=dev)
    params = torch.randn(numel, device=dev).to(torch.bfloat16)
    ag = WeightAllGather(groups, config, params, 1)
    errors = []
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        grads.mul_(1.0)
        for make in (lambda: rs.start(grads, shard, 0), lambda: ag.start(params, 0),
                     lambda: GradReduceScatter(groups, config, numel, 2, device=dev)):
            try:
                make()
            except Sdp4bitError as error:
                errors.append(str(error))
    graph.replay()
    rs.start(grads, shard, 0).wait()
    ag.start(params, 0).wait()
    torch.cuda.synchronize()
    groups.close()
    return errors


def buckets_beside_the_groups_device(rank, world):
    """Both ranks make their groups and set up their buckets with cuda:0 current, the buckets
    on cuda:<rank>, over NCCL (whose set-up agreement stages host bytes through the executor
    thread's device: cuda:0 on both ranks would be one GPU for two NCCL ranks); a gradient and a
    weight step against the in-process collective. Needs 2 GPUs."""
    torch.cuda.set_device(0)
    groups = ProcessGroups.create(node_labels=[0] * world)
    dev = torch.device("cuda", rank)
    config = Config("sdp4bit")
    numel = world * 4096
    inputs = scenarios.gradients(world, numel, seed=3)
    rs = GradReduceScatter(groups, config, numel, 0, device=dev)
    shard = torch.empty(rs.shard_len, device=dev)
    rs.start(inputs[rank].to(dev), shard, 0).wait()
    expected = torch.ops.sdp4bit.simulate_grad_reduce_scatter(
        config.spec(), groups.node_labels, 0, 0, inputs)[rank]
    assert scenarios.same_bits(shard.cpu(), expected), "reduce-scatter differs"
    initial, targets = scenarios.weight_targets(numel, steps=1, seed=4)
    params = initial.to(dev, copy=True)
    ag = WeightAllGather(groups, config, params, 1)
    mine = slice(rank * ag.shard_len, (rank + 1) * ag.shard_len)
    params[mine] = targets[0][mine].to(dev)
    ag.start(params, 0).wait()
    expected = torch.ops.sdp4bit.simulate_weight_all_gather(
        config.spec(), groups.node_labels, 1, 0, initial, targets)[0, rank]
    assert scenarios.same_bits(params.cpu(), expected), "all-gather differs"
    groups.close()
    return torch.cuda.current_device()

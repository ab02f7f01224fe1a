"""What each rank runs in the multi-process tests (imported by name in spawned processes)."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

import sdp4bit
from sdp4bit import Config, GradReduceScatter, ProcessGroups, Sdp4bitError, WeightAllGather

PRESETS = sdp4bit.presets()


def gradients(world: int, numel: int, seed: int) -> torch.Tensor:
    """Every rank's bucket: normal values over six decades with a few outlier channels."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(world, numel, generator=g)
    x *= 10.0 ** torch.randint(-3, 3, (world, numel), generator=g).float()
    x[:, ::97] *= 50.0
    return x


def weight_targets(numel: int, steps: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Initial bf16 params and the values an optimizer writes at each of `steps` steps."""
    g = torch.Generator().manual_seed(seed)
    initial = torch.randn(numel, generator=g)
    deltas = 1e-3 * torch.randn(steps, numel, generator=g)
    return initial.bfloat16(), (initial + deltas.cumsum(0)).bfloat16()


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Byte-for-byte equality (NaNs with equal payloads compare equal)."""
    view = torch.int32 if a.dtype == torch.float32 else torch.int16
    return a.shape == b.shape and torch.equal(a.view(view), b.view(view))


def replicas_identical(params: torch.Tensor) -> bool:
    """Whether every rank holds the same bits in `params` (on the device the default group's
    backend exchanges: CUDA for NCCL, the CPU for gloo)."""
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    bits = params.view(torch.int16).to(device=device, dtype=torch.int32)  # gloo has no int16
    gathered = [torch.empty_like(bits) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, bits)
    return all(torch.equal(g, gathered[0]) for g in gathered)


def byte_equal_to_in_process(rank, world, labels, presets, use_env_topology, device="cpu"):
    """Every preset's reduce-scatter (2 steps, shard as a separate tensor and as a view into
    the bucket) and all-gather (3 steps) of buckets on `device` equal the in-process CPU
    collective byte for byte."""
    if use_env_topology:
        groups = ProcessGroups.create()  # LOCAL_WORLD_SIZE from the launcher
    else:
        groups = ProcessGroups.create(node_labels=labels)
    assert groups.node_labels == labels, (groups.node_labels, labels)
    numel = world * 3000  # not a multiple of any group size: exercises the padding
    report = {}
    for bucket_id, preset in enumerate(presets):
        config = Config.from_knobs(preset, {"seed": 77})
        spec = config.spec()
        inputs = gradients(world, numel, seed=bucket_id)
        rs = GradReduceScatter(groups, config, numel, bucket_id, device=device)
        s = rs.shard_len
        for step, as_view in ((0, False), (1, True)):
            bucket = inputs[rank].to(device, copy=True)
            shard = bucket.narrow(0, rank * s, s) if as_view else torch.empty(s, device=device)
            rs.start(bucket, shard, step).wait()
            expected = torch.ops.sdp4bit.simulate_grad_reduce_scatter(
                spec, labels, bucket_id, step, inputs)[rank]
            assert same_bits(shard.cpu(), expected), f"{preset}: reduce-scatter step {step} differs"
            assert torch.isfinite(shard).all(), preset

        initial, targets = weight_targets(numel, steps=3, seed=100 + bucket_id)
        params = initial.to(device, copy=True)
        ag = WeightAllGather(groups, config, params, bucket_id)
        expected = torch.ops.sdp4bit.simulate_weight_all_gather(
            spec, labels, bucket_id, 0, initial, targets)
        mine = slice(rank * ag.shard_len, (rank + 1) * ag.shard_len)
        for step in range(targets.shape[0]):
            params[mine] = targets[step][mine].to(device)
            ag.start(params, step).wait()
            assert same_bits(params.cpu(), expected[step, rank]), f"{preset}: all-gather step {step}"
            assert replicas_identical(params), f"{preset}: replicas differ at step {step}"
        report[preset] = (rs.wire_bytes(1).total, rs.baseline_wire_bytes().total,
                          ag.wire_bytes().total, ag.baseline_wire_bytes().total)
    groups.close()
    return report


def bf16_buckets_equal_their_fp32_conversion(rank, world, labels, presets, device="cpu"):
    """Every preset's reduce-scatter of a bf16 bucket (2 steps, the shard a separate tensor
    and a view into the bucket; the data with NaN and Inf in one case) writes the in-process
    collective's fp32 shard of the bucket's fp32 conversion, rounded to bf16 as torch rounds
    (`.bfloat16()`), byte for byte; NaN stays NaN and Inf stays Inf."""
    groups = ProcessGroups.create(node_labels=labels)
    numel = world * 3000
    for bucket_id, preset in enumerate(presets):
        config = Config.from_knobs(preset, {"seed": 91})
        rs = GradReduceScatter(groups, config, numel, bucket_id, device=device)
        s = rs.shard_len
        for step, as_view in ((0, False), (1, True)):
            inputs = gradients(world, numel, seed=300 + 2 * bucket_id + step).bfloat16()
            if step == 1:
                every_shard = torch.arange(world) * (numel // world)
                inputs[0, every_shard + 5] = float("nan")
                inputs[world - 1, every_shard + 9] = float("inf")
            bucket = inputs[rank].to(device, copy=True)
            shard = (bucket.narrow(0, rank * s, s) if as_view
                     else torch.empty(s, dtype=torch.bfloat16, device=device))
            rs.start(bucket, shard, step).wait()
            expected = torch.ops.sdp4bit.simulate_grad_reduce_scatter(
                config.spec(), labels, bucket_id, step, inputs.float())[rank].bfloat16()
            got = shard.cpu()
            assert got.dtype == torch.bfloat16, got.dtype
            nan = torch.isnan(expected)
            assert torch.equal(torch.isnan(got), nan), f"{preset}: NaN elements differ"
            assert same_bits(got[~nan], expected[~nan]), f"{preset}: step {step} differs"
            if step == 1:
                assert not torch.isfinite(got).all(), f"{preset}: NaN / Inf did not arrive"
    groups.close()


def pipelined_chunks_equal_one_chunk(rank, world, labels, device="cpu"):
    """Chunks in flight over the process groups (each chunk's all-to-alls issued while its
    neighbours are computed; on CUDA, on the process group's stream while the side stream
    computes): an explicit P and the automatic P of a large bucket give the in-process
    collective's bytes, and those of P = 1 (the padding is P = 1's in both)."""
    groups = ProcessGroups.create(node_labels=labels)
    cases = [("sdp4bit", {"pipeline_chunks": 4}, world * 3 * 8 * 2048),
             ("qsdp", {"pipeline_chunks": 3}, world * 3 * 8 * 2048),
             ("sdp4bit", {}, world * (1 << 19))]  # auto: P > 1
    chunks = []
    for bucket_id, (preset, knobs, numel) in enumerate(cases):
        config = Config.from_knobs(preset, {"seed": 5, **knobs})
        one = Config.from_knobs(preset, {"seed": 5, "pipeline_chunks": 1})
        inputs = gradients(world, numel, seed=40 + bucket_id)
        rs = GradReduceScatter(groups, config, numel, bucket_id, device=device)
        for step in (3, 4):
            shard = torch.empty(rs.shard_len, device=device)
            rs.start(inputs[rank].to(device, copy=True), shard, step).wait()
            for reference in (config, one):
                expected = torch.ops.sdp4bit.simulate_grad_reduce_scatter(
                    reference.spec(), labels, bucket_id, step, inputs)[rank]
                assert same_bits(shard.cpu(), expected), (preset, knobs, reference, step)
        chunks.append(config.values()["pipeline_chunks"])
    groups.close()
    return chunks


def repeated_qwd(rank, world, labels, steps):
    """Replicas stay bit-identical over many qWD all-gathers, and the reconstruction error
    stays within one step's quantization error instead of growing."""
    groups = ProcessGroups.create(node_labels=labels)
    numel = world * 4096
    initial, targets = weight_targets(numel, steps, seed=5)
    params = initial.clone()
    ag = WeightAllGather(groups, Config("sdp4bit"), params, bucket_id=9)
    mine = slice(rank * ag.shard_len, (rank + 1) * ag.shard_len)
    worst = []
    for step in range(steps):
        params[mine] = targets[step][mine]
        handle = ag.start(params, step)
        handle.wait()
        assert handle.is_completed()
        assert replicas_identical(params), f"replicas differ after step {step}"
        worst.append((params.float() - targets[step].float()).abs().max().item())
    groups.close()
    return worst


def nan_reaches_the_owner(rank, world, labels, presets, device="cpu"):
    """A NaN in rank 1's bucket at offset 17 of every shard makes element 17 of every rank's
    reduced shard NaN, for every preset, and the result still equals the in-process one
    (buckets on `device`)."""
    groups = ProcessGroups.create(node_labels=labels)
    numel = world * 2048
    for bucket_id, preset in enumerate(presets):
        config = Config(preset)
        inputs = gradients(world, numel, seed=3)
        s = numel // world
        inputs[1, torch.arange(world) * s + 17] = float("nan")
        rs = GradReduceScatter(groups, config, numel, bucket_id, device=device)
        shard = torch.empty(s, device=device)
        rs.start(inputs[rank].to(device, copy=True), shard, step=4).wait()
        shard = shard.cpu()
        assert torch.isnan(shard[17]), f"{preset}: the NaN did not reach rank {rank}'s shard"
        expected = torch.ops.sdp4bit.simulate_grad_reduce_scatter(
            config.spec(), labels, bucket_id, 4, inputs)[rank]
        assert torch.equal(torch.isnan(shard), torch.isnan(expected)), preset
        finite = ~torch.isnan(shard)
        assert same_bits(shard[finite], expected[finite]), preset
    groups.close()
    return True


def _expect_error(kind, fragment, make):
    start = time.monotonic()
    try:
        make()
    except kind as error:
        assert fragment in str(error), f"expected {fragment!r} in: {error}"
        return str(error), time.monotonic() - start
    raise AssertionError(f"no {kind.__name__} containing {fragment!r}")


def mismatched_setups(rank, world):
    """Set-up differences between ranks fail on every rank, quickly, naming the problem; the
    groups still work afterwards."""
    groups = ProcessGroups.create(node_labels=[z // 2 for z in range(world)])
    seen = []
    config = Config("qsdp" if rank == 0 else "sdp4bit")
    seen.append(_expect_error(Sdp4bitError, "config fingerprint",
                              lambda: GradReduceScatter(groups, config, world * 1024, 0)))
    numel = world * (1024 if rank != world - 1 else 2048)
    seen.append(_expect_error(Sdp4bitError, "bucket size",
                              lambda: GradReduceScatter(groups, Config(), numel, 0)))
    seen.append(_expect_error(Sdp4bitError, "bucket id",
                              lambda: GradReduceScatter(groups, Config(), world * 1024,
                                                        rank % 2)))
    seed = Config.from_knobs("sdp4bit", {"seed": 1 if rank == 1 else 2})
    seen.append(_expect_error(Sdp4bitError, "config fingerprint",
                              lambda: WeightAllGather(groups, seed, torch.zeros(world * 1024,
                                                      dtype=torch.bfloat16), 0)))
    # A bad input on one rank only: that rank names it, the others name that rank.
    dtype = torch.float32 if rank == 2 else torch.bfloat16
    fragment = "must be BFloat16" if rank == 2 else "rank 2 failed to set up"
    seen.append(_expect_error(Sdp4bitError, fragment,
                              lambda: WeightAllGather(groups, Config(),
                                                      torch.zeros(world * 1024, dtype=dtype), 0)))
    # A device one rank cannot use (a bad name; CUDA where the host has no GPU): that rank
    # names it, the others name that rank.
    device, problem = (("cuda:0", "cannot run") if not torch.cuda.is_available()
                       else ("xla:0", "buckets live on CPU or CUDA"))
    fragment = problem if rank == 3 else "rank 3 failed to set up"
    seen.append(_expect_error(Sdp4bitError, fragment,
                              lambda: GradReduceScatter(groups, Config(), world * 1024, 0,
                                                        device=device if rank == 3 else "cpu")))
    # An invalid knob on one rank only.
    knobs = {"weight_bits": 5} if rank == 1 else {}
    fragment = "weight_bits=5" if rank == 1 else "rank 1 failed to set up"
    seen.append(_expect_error(Sdp4bitError, fragment,
                              lambda: GradReduceScatter(groups, Config.from_knobs("sdp4bit", knobs),
                                                        world * 1024, 0)))
    # Still usable.
    rs = GradReduceScatter(groups, Config(), world * 1024, 0)
    shard = torch.empty(rs.shard_len)
    rs.start(torch.ones(world * 1024), shard, 0).wait()
    assert torch.allclose(shard, torch.full_like(shard, float(world)), rtol=0.1)
    # Groups that serve CPU buckets take no CUDA bucket (nor the reverse): that rank names it
    # before it looks at the device, the others name that rank.
    fragment = "needs its own sdp4bit.ProcessGroups" if rank == 3 else "rank 3 failed to set up"
    seen.append(_expect_error(Sdp4bitError, fragment,
                              lambda: GradReduceScatter(groups, Config(), world * 1024, 1,
                                                        device="cuda:0" if rank == 3 else "cpu")))
    groups.close()
    return [(message, seconds) for message, seconds in seen]


def bad_inputs(rank, world):
    """Bad inputs (the same on every rank) raise exceptions that name the problem; the groups
    and buckets still work afterwards. Needs W = 4."""
    groups = ProcessGroups.create(node_labels=[z // 2 for z in range(world)])
    rs = GradReduceScatter(groups, Config(), world * 1024, 0)
    s = rs.shard_len
    good = torch.zeros(world * 1024)
    cases = [
        (TypeError, "must be torch.float32 or torch.bfloat16, got torch.float16",
         lambda: rs.start(good.half(), torch.empty(s), 0)),
        (TypeError, "gradient shard is torch.float32 but the gradient bucket is torch.bfloat16",
         lambda: rs.start(good.bfloat16(), torch.empty(s), 0)),
        (TypeError, "gradient shard is torch.bfloat16 but the gradient bucket is torch.float32",
         lambda: rs.start(good, torch.empty(s, dtype=torch.bfloat16), 0)),
        (ValueError, "has 1000 elements, the bucket was planned for",
         lambda: rs.start(torch.zeros(1000), torch.empty(s), 0)),
        (ValueError, "gradient shard has", lambda: rs.start(good, torch.empty(s + 1), 0)),
        (ValueError, "is on meta", lambda: rs.start(good.to("meta"), torch.empty(s), 0)),
        (ValueError, "must be contiguous",
         lambda: rs.start(torch.zeros(world * 2048)[::2], torch.empty(s), 0)),
        (ValueError, "step must be a non-negative int", lambda: rs.start(good, torch.empty(s), -1)),
        (TypeError, "must be a torch.Tensor", lambda: rs.start([0.0], torch.empty(s), 0)),
        (Sdp4bitError, "unknown preset 'sdp5bit'",
         lambda: GradReduceScatter(groups, Config("sdp5bit"), world * 1024, 1)),
        (Sdp4bitError, "weight_bits=3",
         lambda: GradReduceScatter(groups, Config.from_knobs("sdp4bit", {"weight_bits": 3}),
                                   world * 1024, 1)),
        (Sdp4bitError, "hadamard_block",
         lambda: GradReduceScatter(groups, Config.from_knobs("qsdp", {"hadamard_block": 32}),
                                   world * 1024, 1)),
        (Sdp4bitError, "does not split into",
         lambda: GradReduceScatter(groups, Config(), world * 1024 + 1, 1)),
        (Sdp4bitError, "bucket_id 5000",
         lambda: GradReduceScatter(groups, Config(), world * 1024, 5000)),
        (ValueError, "node labels for a DP group",
         lambda: ProcessGroups.create(node_labels=[0] * (world + 1))),
        (ValueError, "order the nodes differently from the global ranks",
         lambda: ProcessGroups.create(node_labels=[1, 0, 0, 1])),
        (Sdp4bitError, "no side stream for collective 'broadcast'",
         lambda: groups.side_stream(torch.device("cuda", 0), "broadcast")),
        (TypeError, "must be torch.bfloat16",
         lambda: WeightAllGather(groups, Config(), torch.zeros(world * 1024,
                                 dtype=torch.bfloat16), 2).start(torch.zeros(world * 1024), 0)),
    ]
    seen = [_expect_error(kind, fragment, make) for kind, fragment, make in cases]
    shard = torch.empty(s)
    rs.start(torch.full((world * 1024,), 2.0), shard, 0).wait()
    assert torch.allclose(shard, torch.full_like(shard, 2.0 * world), rtol=0.1)
    groups.close()
    return seen


def many_buckets_in_flight(rank, world, labels):
    """Several buckets started back to back and waited in reverse order (what overlapped
    training does), and a handle dropped without wait(), give the in-process results."""
    groups = ProcessGroups.create(node_labels=labels)
    numel = world * 2048
    config = Config.from_knobs("sdp4bit", {"pipeline_chunks": 2})
    buckets = [GradReduceScatter(groups, config, numel, bucket_id) for bucket_id in range(3)]
    inputs = [gradients(world, numel, seed=20 + b) for b in range(3)]
    shards = [torch.empty(rs.shard_len) for rs in buckets]
    handles = [rs.start(x[rank].clone(), out, 6) for rs, x, out in zip(buckets, inputs, shards)]
    for handle in reversed(handles):
        handle.wait()
    for bucket_id, (x, out) in enumerate(zip(inputs, shards)):
        expected = torch.ops.sdp4bit.simulate_grad_reduce_scatter(
            config.spec(), labels, bucket_id, 6, x)[rank]
        assert same_bits(out, expected), f"bucket {bucket_id}"
    # A dropped handle still completes, in order, before the next collective of the bucket.
    dropped = torch.empty(buckets[0].shard_len)
    buckets[0].start(inputs[0][rank].clone(), dropped, 7)
    again = torch.empty(buckets[0].shard_len)
    buckets[0].start(inputs[0][rank].clone(), again, 7).wait()
    assert same_bits(dropped, again)
    # close() completes what was started, then refuses new collectives; twice is harmless.
    unwaited = torch.full((buckets[1].shard_len,), float("nan"))
    buckets[1].start(inputs[1][rank].clone(), unwaited, 6)
    groups.close()
    groups.close()
    expected = torch.ops.sdp4bit.simulate_grad_reduce_scatter(
        config.spec(), labels, 1, 6, inputs[1])[rank]
    assert same_bits(unwaited, expected), "close() did not complete the collective in flight"
    _expect_error(Sdp4bitError, "process groups were closed",
                  lambda: buckets[2].start(inputs[2][rank].clone(), shards[2], 8))
    return True


def profiled_collectives(rank, world, labels, trace_dir):
    """One gradient reduce-scatter and one weight all-gather of the sdp4bit preset, each
    started and waited for under torch.profiler (CPU activity); writes this rank's Chrome
    trace to `trace_dir` and returns its path and the training thread's id."""
    import os
    import threading

    from torch.profiler import ProfilerActivity, profile

    groups = ProcessGroups.create(node_labels=labels)
    config = Config("sdp4bit")
    numel = world * 4096
    rs = GradReduceScatter(groups, config, numel, 0)
    params = torch.zeros(numel, dtype=torch.bfloat16)
    ag = WeightAllGather(groups, config, params, 1)
    bucket = gradients(world, numel, seed=5)[rank].clone()
    shard = torch.empty(rs.shard_len)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        rs.start(bucket, shard, 0).wait()
        params.add_(0.01)
        ag.start(params, 0).wait()
    groups.close()
    path = os.path.join(trace_dir, f"trace-rank{rank}.json")
    prof.export_chrome_trace(path)
    return path, threading.get_native_id()

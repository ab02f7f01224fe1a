"""Rank code of the cross-group all-reduce tests: W = 4 as 2 groups of 2 ranks (groups {0, 1}
and {2, 3}), so the ranks holding the same shard are {0, 2} and {1, 3}."""

from __future__ import annotations

import torch
import torch.distributed as dist

from scenarios import _expect_error, gradients, same_bits
from sdp4bit import Config, CrossGroupAllReduce, ProcessGroups, Sdp4bitError

GROUP_SIZE = 2
BUCKET = 5


def _cross_groups(rank: int, world: int) -> tuple[ProcessGroups, list[int]]:
    """This rank's cross-group process groups (every rank builds every group, in order) and
    the global ranks in it."""
    members = [list(range(i, world, GROUP_SIZE)) for i in range(GROUP_SIZE)]
    mine = members[rank % GROUP_SIZE]
    groups = None
    for ranks in members:
        group = dist.new_group(ranks)
        if ranks is mine:
            groups = ProcessGroups.create(group, node_labels=list(range(len(ranks))))
    return groups, mine


def byte_equal_to_in_process(rank, world, numel, steps):
    """Every step's all-reduce (fp32 and bf16 buffers, 8- and 16-bit integers) leaves the
    ranks of a cross group with the in-process reference's bits; returns (wire bytes,
    baseline wire bytes) of the 8-bit one."""
    groups, members = _cross_groups(rank, world)
    for bits in ("8", "16"):
        config = Config.from_knobs("sdp4bit", {"cross_group_bits": bits, "seed": 21})
        ar = CrossGroupAllReduce(groups, config, numel, BUCKET, stream_rank=rank)
        for step in range(steps):
            every = gradients(world, numel, 1000 * step + int(bits))
            for dtype in (torch.float32, torch.bfloat16):
                inputs = torch.stack([every[r].to(dtype).float() for r in members])
                data = every[rank].to(dtype, copy=True)
                ar.start(data, step).wait()
                want = torch.ops.sdp4bit.simulate_cross_group_all_reduce(
                    config.spec(), BUCKET, step, members, inputs)[members.index(rank)]
                assert same_bits(data, want.to(dtype)), (bits, step, dtype)
        if bits == "8":
            sent = (ar.wire_bytes(), ar.baseline_wire_bytes())
    groups.close()
    return sent


def nan_reaches_every_group(rank, world):
    """A NaN in rank 2's buffer makes the all-reduced buffer all NaN in its cross group
    ({0, 2}), which the framework's found-inf check then sees; the other group is finite."""
    groups, members = _cross_groups(rank, world)
    ar = CrossGroupAllReduce(groups, Config("sdp4bit"), 64, BUCKET, stream_rank=rank)
    data = gradients(world, 64, 3)[rank].clone()
    if rank == 2:
        data[17] = float("nan")
    ar.start(data, 0).wait()
    groups.close()
    return bool(data.isnan().all()), bool(data.isfinite().all())


def mismatched_setups(rank, world):
    """Set-ups that differ between the ranks of a cross group fail on every rank of it,
    naming the problem; so do bad plans."""
    groups, _ = _cross_groups(rank, world)
    seen = []
    bits = Config.from_knobs("sdp4bit", {"cross_group_bits": "16" if rank >= 2 else "8"})
    seen.append(_expect_error(Sdp4bitError, "config fingerprint",
                              lambda: CrossGroupAllReduce(groups, bits, 64, BUCKET, rank)))
    seen.append(_expect_error(Sdp4bitError, "bucket size",
                              lambda: CrossGroupAllReduce(groups, Config(), 64 + 2 * (rank >= 2),
                                                          BUCKET, rank)))
    seen.append(_expect_error(Sdp4bitError, "multiple of the group count",
                              lambda: CrossGroupAllReduce(groups, Config(), 63, BUCKET, rank)))
    exact = Config.from_knobs("sdp4bit", {"cross_group_bits": "exact"})
    seen.append(_expect_error(Sdp4bitError, "cross_group_bits=exact",
                              lambda: CrossGroupAllReduce(groups, exact, 64, BUCKET, rank)))
    groups.close()
    return [message for message, _ in seen]

"""Global-QSGD's integer-sum overflows of CUDA buckets, raised on every rank at the same
``start()`` (collectives._IntegerSumAgreement, docs/cuda.md). A CUDA bucket reads its status
word back without waiting for the device, so each rank sees its overflow at a step of its own;
only corrupted codes overflow, so the readback is injected (`Readback`) into a bucket whose
agreement, gloo exchange, error text and enqueuing are the real ones: a CPU bucket here, a
CUDA bucket in test_cuda.py."""

from __future__ import annotations

import time

import torch

from sdp4bit import Config, GradReduceScatter, ProcessGroups, Sdp4bitError
from sdp4bit.collectives import _IntegerSumAgreement

#: Steps each scenario runs.
STEPS = 9


def status_word(block: int, element: int, shard_len: int) -> int:
    """The status word recording the first overflow at `element` of the shard, met when
    adding `block` in rank order (backend::cuda::abi::overflow_from_status's inverse)."""
    return 2**32 - 1 - (block * shard_len + element)


def reports(rank: int, shard_len: int) -> dict[int, int]:
    """What rank `rank`'s readback reports at which start(): rank 2's overflow lands at its
    start 3; rank 3's and rank 1's at start 6, so the lower rank's is raised."""
    return {
        1: {6: status_word(2, 7, shard_len)},
        2: {3: status_word(1, 5, shard_len)},
        3: {6: status_word(1, 0, shard_len)},
    }.get(rank, {})


def expected_raises(shard_len: int) -> list[tuple[int, str]]:
    """The (step, error) every rank raises: each overflow at the start after it landed, named
    as its own rank's host sum names it (element rank * shard_len + i)."""
    error = "collective failed: reduce_scatter (int8): sum overflows at element {} of {}"
    return [(4, error.format(2 * shard_len + 5, shard_len)),
            (7, error.format(shard_len + 7, shard_len))]


class Readback:
    """A bucket's extension object whose integer-sum readback reports `reports[i]` at the
    i-th start(), and the bucket's own readback elsewhere (0 without an overflow; a CPU
    bucket has none); everything else is the bucket's own."""

    def __init__(self, native, reports: dict[int, int]) -> None:
        self._native, self._reports, self._starts = native, reports, 0

    def take_integer_sum_status(self) -> int:
        own = self._native.take_integer_sum_status()
        status = self._reports.get(self._starts, own)
        self._starts += 1
        return status

    def __getattr__(self, name):
        return getattr(self._native, name)


def overflows_raise_at_once(rank, world, device):
    """The errors each rank raised and at which start() (hosts out of step by up to 20 ms),
    its shard length and whether the bucket agrees on its overflows itself (a CUDA bucket; a
    CPU bucket raises its own from its step, so the agreement is added); the shards of the
    other steps equal the in-process collective's. Needs W = 4."""
    if device != "cpu":
        torch.cuda.set_device(device)
    groups = ProcessGroups.create(node_labels=[0, 0, 1, 1])
    config = Config("global-qsgd")
    numel = world * 1024
    rs = GradReduceScatter(groups, config, numel, 0, device=device)
    own = rs._sums is not None
    if not own:
        rs._sums = _IntegerSumAgreement(groups.host_group(), rank)
    rs._native = Readback(rs._native, reports(rank, rs.shard_len))
    inputs = torch.randn(world, numel, generator=torch.Generator().manual_seed(5))
    raised = []
    for step in range(STEPS):
        time.sleep(0.01 * ((rank + step) % 3))
        bucket = inputs[rank].to(device, copy=True)
        shard = torch.empty(rs.shard_len, device=device)
        try:
            handle = rs.start(bucket, shard, step)
        except Sdp4bitError as error:
            raised.append((step, str(error)))
            continue
        handle.wait()
        # No rank enqueued the steps that raised: every other step pairs up on every rank.
        expected = torch.ops.sdp4bit.simulate_grad_reduce_scatter(
            config.spec(), groups.node_labels, 0, step, inputs)[rank]
        assert torch.equal(shard.cpu(), expected), f"rank {rank}: step {step} differs"
    groups.close()
    return raised, rs.shard_len, own

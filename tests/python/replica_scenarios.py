"""What each rank runs in test_replicas.py (and test_cuda.py's replica check): the set-up check
that every replica holds the same parameters, its memory and its verdicts (imported by name in
the rank processes)."""

from __future__ import annotations

import re

import torch
import torch.distributed as dist

from sdp4bit import Sdp4bitError, replicas


def _params(numel: int, device: str) -> torch.Tensor:
    """A bf16 param bucket of `numel` elements, the same on every rank."""
    values = torch.randn(numel, generator=torch.Generator().manual_seed(0))
    return values.bfloat16().to(device)


def _status_bytes(field: str) -> int:
    """A `kB` field of /proc/self/status, in bytes."""
    with open("/proc/self/status") as status:
        return int(re.search(rf"^{field}:\s+(\d+) kB$", status.read(), re.M).group(1)) * 1024


def check_memory(rank, world, numel, chunk, device):
    """The most memory the replica check of one identical bucket of `numel` params takes at
    once on its device, beyond what was held before, with ``replicas.CHUNK = chunk``: the peak
    of the process's resident set (VmHWM, reset through /proc/self/clear_refs) for a CPU
    bucket, of torch's CUDA allocator for a CUDA one."""
    replicas.CHUNK = chunk
    params = _params(numel, device)
    replicas.check_replicas_identical([params[:64]], dist.group.WORLD)  # the group's set-up
    if device == "cpu":
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")  # the peak resident set restarts from the current one
        before = _status_bytes("VmRSS")
        replicas.check_replicas_identical([params], dist.group.WORLD)
        return _status_bytes("VmHWM") - before
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    replicas.check_replicas_identical([params], dist.group.WORLD)
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before


def verdicts(rank, world, numel, chunk, cases):
    """For each `(differing_rank, index)` of `cases`, checks two buckets (`numel` and
    ``numel + 3`` params, ``CHUNK = chunk``) that are the same on every rank but
    `differing_rank` (None: none), whose element `index` of the second bucket has one bit
    flipped; returns each check's error message, or None where it passed."""
    replicas.CHUNK = chunk
    found = []
    for differing_rank, index in cases:
        buckets = [_params(numel, "cpu"), _params(numel + 3, "cpu")]
        if rank == differing_rank:
            buckets[1].view(torch.int16)[index] ^= 1
        try:
            replicas.check_replicas_identical(buckets, dist.group.WORLD)
            found.append(None)
        except Sdp4bitError as error:
            found.append(str(error))
    return found

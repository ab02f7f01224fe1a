"""The check that every DP replica holds the same parameter buffers, which the weight codecs
need when they set up (qWD sends differences from the values every replica holds)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .errors import Sdp4bitError


def check_replicas_identical(buffers: list[torch.Tensor], group) -> None:
    """Raises :class:`Sdp4bitError` on every rank of `group` unless all of them hold the same
    `buffers` (bf16 or other 16-bit tensors), compared by a position-weighted checksum of their
    bits, all-gathered over `group`."""
    sums = []
    for buffer in buffers:
        bits = buffer.detach().reshape(-1).view(torch.int16).to(torch.int64)
        weights = torch.arange(1, bits.numel() + 1, dtype=torch.int64, device=bits.device) % 65521
        sums.append(int((bits * (weights + 1)).sum()))
    # On the buffers' device: an NCCL group exchanges CUDA tensors, gloo takes either.
    device = buffers[0].device if buffers else torch.device("cpu")
    mine = torch.tensor(sums, dtype=torch.int64, device=device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    differing = [r for r, theirs in enumerate(every) if not torch.equal(theirs, every[0])]
    if differing:
        raise Sdp4bitError(
            f"DP ranks {differing} hold different parameters than DP rank 0 when sdp4bit sets "
            "up; the weight codecs need identical replicas (broadcast the parameters, or use "
            "the same initialization seed on every DP rank)"
        )

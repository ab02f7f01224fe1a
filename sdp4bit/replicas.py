"""The check that every DP replica holds the same parameter buffers, which the weight codecs
need when they set up (qWD sends differences from the values every replica holds)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .errors import Sdp4bitError

#: Elements checksummed at a time: the check allocates two int64 tensors of one chunk (16 MiB,
#: on the buffers' device) and reuses them for every chunk, whatever the size of the buffers.
CHUNK = 1 << 20


def _checksum(buffer: torch.Tensor) -> torch.Tensor:
    """The position-weighted sum of the bits of `buffer` (a contiguous 16-bit tensor): element
    i's bits times ``(i + 1) % 65521 + 1``, summed in int64, as a 0-dim tensor on the buffer's
    device; computed `CHUNK` elements at a time."""
    bits = buffer.detach().view(-1).view(torch.int16)
    chunk_values = torch.empty(min(CHUNK, bits.numel()), dtype=torch.int64, device=bits.device)
    chunk_weights = torch.empty_like(chunk_values)
    total = torch.zeros((), dtype=torch.int64, device=bits.device)
    for start in range(0, bits.numel(), CHUNK):
        stop = min(start + CHUNK, bits.numel())
        values = chunk_values[:stop - start].copy_(bits[start:stop])
        weights = torch.arange(start + 1, stop + 1, out=chunk_weights[:stop - start])
        total += weights.remainder_(65521).add_(1).mul_(values).sum()
    return total


def check_replicas_identical(buffers: list[torch.Tensor], group) -> None:
    """Raises :class:`Sdp4bitError` on every rank of `group` unless all of them hold the same
    `buffers` (contiguous bf16 or other 16-bit tensors), compared by a position-weighted
    checksum of their bits, all-gathered over `group`."""
    sums = [_checksum(b) for b in buffers]
    # On the buffers' device: an NCCL group exchanges CUDA tensors, gloo takes either.
    mine = torch.stack(sums) if sums else torch.zeros(0, dtype=torch.int64)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    differing = [r for r, theirs in enumerate(every) if not torch.equal(theirs, every[0])]
    if differing:
        raise Sdp4bitError(
            f"DP ranks {differing} hold different parameters than DP rank 0 when sdp4bit sets "
            "up; the weight codecs need identical replicas (broadcast the parameters, or use "
            "the same initialization seed on every DP rank)"
        )

"""Checks that copies of parameters hold the same bits: every DP replica's buffers, which the
weight codecs need when they set up (qWD sends differences from the values every replica
holds), and any tensors across a group (megatron_patch compares the copies Megatron keeps
identical across tensor-parallel ranks and pipeline stages)."""

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


def checksums_across(tensors: list[torch.Tensor], group) -> torch.Tensor:
    """Every rank of `group`'s checksums of its `tensors` (contiguous 16-bit tensors, the same
    number on every rank): a position-weighted sum of each tensor's bits, all-gathered over
    `group`; an int64 CPU tensor of (ranks of `group`) x (tensors)."""
    sums = [_checksum(t) for t in tensors]
    # On the tensors' device: an NCCL group exchanges CUDA tensors, gloo takes either.
    mine = torch.stack(sums) if sums else torch.zeros(0, dtype=torch.int64)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    return torch.stack(every).cpu()


def check_replicas_identical(buffers: list[torch.Tensor], group,
                             when: str = "when sdp4bit sets up") -> None:
    """Raises :class:`Sdp4bitError` on every rank of `group` unless all of them hold the same
    `buffers` (contiguous bf16 or other 16-bit tensors), compared by
    :func:`checksums_across`; `when` says at which point, for the error."""
    every = checksums_across(buffers, group)
    differing = [r for r, theirs in enumerate(every) if not torch.equal(theirs, every[0])]
    if differing:
        raise Sdp4bitError(
            f"DP ranks {differing} hold different parameters than DP rank 0 {when}; the "
            "weight codecs need identical replicas (broadcast the parameters, or use the same "
            "initialization seed on every DP rank, or load the same weights on every DP rank)"
        )

"""Parameters kept exact (the ``exact_params`` knob; docs/megatron.md, "Parameters kept
exact"): which parameters a mode keeps exact, and :class:`ExactElements`, the exact paths of
one bucket's elements beside its compressed collectives, held as ranges of the bucket."""

from __future__ import annotations

import torch
import torch.distributed as dist

from sdp4bit.integration import ring_all_reduce_bytes

from .parallel import tensor_parallel_group


def exact_params(ddp, mode: str) -> set:
    """The parameters of the DDP model `ddp` that the ``exact_params`` knob's `mode` keeps
    exact: none; those Megatron replicates across tensor-parallel ranks (no
    ``tensor_model_parallel`` attribute, when TP > 1); or those plus every 1-D parameter (norm
    weights and biases, every bias) and the embedding tables (the word embedding, tied or not,
    and learned position embeddings)."""
    from megatron.core.tensor_parallel.layers import VocabParallelEmbedding

    if mode == "none":
        return set()
    params = list(ddp.module.parameters())
    exact = set()
    if tensor_parallel_group(ddp).size() > 1:
        exact.update(p for p in params if not getattr(p, "tensor_model_parallel", False))
    if mode == "norms-biases-embeddings":
        exact.update(p for p in params if p.dim() == 1 or getattr(p, "shared_embedding", False))
        exact.update(m.weight for m in ddp.module.modules()
                     if isinstance(m, (torch.nn.Embedding, VocabParallelEmbedding)))
    return exact


def merged_ranges(ranges) -> list[tuple[int, int]]:
    """`ranges` (start, end) sorted, the adjacent or overlapping ones merged."""
    merged: list[tuple[int, int]] = []
    for start, end in sorted(ranges):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(end, merged[-1][1]))
        else:
            merged.append((start, end))
    return merged


class ExactElements:
    """The elements of one bucket that travel exact beside its compressed collectives, as
    ranges (start, end) of the bucket, the same on every DP rank: O(parameters) of memory
    whatever their size. Each path is one asynchronous all-reduce over the DP group of the
    elements packed into one buffer, issued before the compressed collective starts and
    completed after it, from the training thread in program order.

    Inside the compressed all-gather this rank's exact elements always carry 0 (taken out at
    set-up and at every :meth:`start_params`): qWD's reference for them stays 0, so its
    difference and code are 0 and every replica's apply leaves them as they were; a direct
    encoding sees zeros, which widen no scale. What the compressed path carries for them thus
    depends on nothing a checkpoint would need to hold."""

    def __init__(self, ranges, rank: int, shard_len: int) -> None:
        self.ranges = merged_ranges(ranges)
        self.numel = sum(end - start for start, end in self.ranges)
        self.first = rank * shard_len  # this rank's shard: [first, first + shard_len)
        # This rank's part of each range: (start in the bucket, end, offset in the packed
        # buffer of every range's elements).
        self.own: list[tuple[int, int, int]] = []
        offset = 0
        for start, end in self.ranges:
            low, high = max(start, self.first), min(end, self.first + shard_len)
            if low < high:
                self.own.append((low, high, offset + low - start))
            offset += end - start

    def _pack(self, data: torch.Tensor) -> torch.Tensor:
        """Every range of `data`, concatenated (a new tensor)."""
        return torch.cat([data[start:end] for start, end in self.ranges])

    def take_own(self, params: torch.Tensor) -> torch.Tensor:
        """Moves this rank's exact elements of `params` out, leaving 0 there: returns them
        packed (a buffer of every range's elements, 0 but for this rank's)."""
        values = torch.zeros(self.numel, dtype=params.dtype, device=params.device)
        for start, end, offset in self.own:
            values[offset:offset + end - start].copy_(params[start:end])
            params[start:end].zero_()
        return values

    def put_own(self, params: torch.Tensor, values: torch.Tensor) -> None:
        """Puts back into `params` this rank's elements of what :meth:`take_own` returned."""
        for start, end, offset in self.own:
            params[start:end].copy_(values[offset:offset + end - start])

    def start_grads(self, grads: torch.Tensor, group):
        """Issues the fp32 sum over `group` of every rank's exact elements of `grads`."""
        values = self._pack(grads).float()
        return dist.all_reduce(values, group=group, async_op=True), values

    def continue_grads(self, pending, group):
        """Completes :meth:`start_grads` and issues the sum of its sums over `group` (the
        distributed-optimizer instances' group: every rank that holds this rank's shard in
        another instance)."""
        work, values = pending
        work.wait()
        return dist.all_reduce(values, group=group, async_op=True), values

    def finish_grads(self, pending, shard: torch.Tensor) -> None:
        """Completes :meth:`start_grads` (or :meth:`continue_grads`) and writes the sums of
        this rank's elements into `shard`, over what the compressed collectives gave them."""
        work, values = pending
        work.wait()
        for start, end, offset in self.own:
            shard[start - self.first:end - self.first].copy_(values[offset:offset + end - start])

    def start_params(self, params: torch.Tensor, group):
        """Takes this rank's new exact values out of `params`, leaving 0 there for the
        compressed all-gather, and issues their all-gather over `group`: a byte-wise SUM
        all-reduce of every rank's exact elements, each byte non-zero on its owner only,
        which adds nothing to it."""
        values = self.take_own(params)
        return dist.all_reduce(values.view(torch.uint8), group=group, async_op=True), values

    def finish_params(self, pending, params: torch.Tensor) -> None:
        """Completes :meth:`start_params` and writes every owner's exact values into
        `params`."""
        work, values = pending
        work.wait()
        offset = 0
        for start, end in self.ranges:
            params[start:end].copy_(values[offset:offset + end - start])
            offset += end - start

    def wire_bytes(self, world: int, element_bytes: int) -> int:
        """Bytes one rank sends in one all-reduce of the elements, `element_bytes` each, over
        `world` ranks, as a ring sends them (a reduce-scatter, then an all-gather)."""
        return ring_all_reduce_bytes(self.numel, world, element_bytes)

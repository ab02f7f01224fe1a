"""Hybrid sharding (``num_distributed_optimizer_instances > 1``; docs/megatron.md, "Hybrid
sharding"): the all-reduce of each bucket's shard across the distributed-optimizer
instances, after the reduce-scatter inside the instance."""

from __future__ import annotations

import torch
import torch.distributed as dist

from sdp4bit import Config, CrossGroupAllReduce, ProcessGroups
from sdp4bit.integration import (WireCounter, cross_group_buffer, cross_group_len,
                                 ring_all_reduce_bytes)


class AcrossInstances:
    """The all-reduce of each bucket's shard of one bucket group across the instances: with
    ``cross_group_bits`` 8 or 16, Global-QSGD integers summed over `groups` (the instances'
    sdp4bit groups, shared by every bucket group; :class:`sdp4bit.CrossGroupAllReduce`,
    numerics §7.6), a bucket kept exact whole and ``cross_group_bits=exact`` through
    Megatron's own fp32 all-reduce over `group`. Run from the training thread after the
    reduce-scatter inside the instance, as megatron-core runs it."""

    def __init__(self, config: Config, group: dist.ProcessGroup, groups: ProcessGroups | None,
                 shard_lens: list[int], bucket_ids: list[int], exact: list[bool],
                 device: torch.device) -> None:
        self.group = group
        self.size = group.size()
        self.shard_lens = shard_lens
        self.reduces: list[CrossGroupAllReduce | None] = [None] * len(shard_lens)
        if groups is not None:
            rank = dist.get_rank()
            self.reduces = [
                None if whole else CrossGroupAllReduce(
                    groups, config, cross_group_len(n, self.size), bucket_id,
                    stream_rank=rank, device=device)
                for n, bucket_id, whole in zip(shard_lens, bucket_ids, exact)]

    def run(self, shards: list[torch.Tensor], step: int) -> None:
        """All-reduces every bucket's shard in place across the instances."""
        handles, buffers = [], []
        for shard, reduce in zip(shards, self.reduces):
            if reduce is None:
                handles.append(dist.all_reduce(shard, group=self.group, async_op=True))
                buffers.append(shard)
                continue
            buffers.append(cross_group_buffer(shard, self.size))
            handles.append(reduce.start(buffers[-1], step))
        for shard, handle, data in zip(shards, handles, buffers):
            handle.wait()
            if data is not shard:
                shard.copy_(data[:shard.numel()])

    def compresses(self) -> bool:
        """Whether any bucket's all-reduce is Global-QSGD's."""
        return any(reduce is not None for reduce in self.reduces)

    def count(self, wire: WireCounter) -> None:
        """Adds one call's bytes, and Megatron's fp32 ring all-reduce's, to `wire`."""
        for reduce, n in zip(self.reduces, self.shard_lens):
            ring = ring_all_reduce_bytes(n, self.size)
            if reduce is None:
                wire.add(ring, ring)
            else:
                wire.add(reduce.wire_bytes(), ring)

"""Where ZeRO stage 1/2's gradient buckets lie in a parameter group's flat buffer, and which of
their reduce-scattered shards fill which rank's ZeRO partition.

DeepSpeed partitions a group's flat buffer into W contiguous equal partitions and reduces each
IPG bucket to the owners of its pieces. sdp4bit instead reduce-scatters each bucket into W
equal shards (the balanced collective the codecs compress), so after the backward pass rank j
holds shard j of every bucket; at the accumulation boundary one all-to-all moves each shard's
pieces to the partitions they belong to (:func:`runs_between`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BucketSpan:
    """One bucket: the flat range ``[lo, hi)`` and the parameters inside it (indices into the
    group's parameter list), reduce-scattered as ``padded`` elements (``hi - lo`` rounded up to a
    multiple of the DP size, zeros at the end)."""

    lo: int
    hi: int
    padded: int
    params: tuple[int, ...]

    def shard(self, rank: int, world: int) -> tuple[int, int]:
        """The flat range of `rank`'s shard of this bucket, padding left out (may be empty)."""
        size = self.padded // world
        start = self.lo + rank * size
        return min(start, self.hi), min(start + size, self.hi)


def plan_buckets(spans: list[tuple[int, int]], total: int, bucket_elements: int,
                 world: int) -> list[BucketSpan]:
    """Cuts a flat buffer of `total` elements holding parameters at `spans` (offset, numel per
    parameter, in the group's order) into buckets in backward order (highest offsets first, as
    autograd produces the gradients of a layered model), each of whole parameters and at most
    `bucket_elements` elements unless a single parameter is larger (DeepSpeed's IPG bucket
    rule for ``reduce_bucket_size``). The buckets tile ``[0, total)``: gaps and the trailing
    alignment padding belong to the bucket below them. Empty parameters are in no bucket (a
    buffer of none but empty parameters is one bucket of padding)."""
    if bucket_elements <= 0:
        raise ValueError(f"reduce_bucket_size must be positive, got {bucket_elements}")
    order = sorted((offset, numel, index) for index, (offset, numel) in enumerate(spans)
                   if numel > 0)
    groups: list[list[tuple[int, int, int]]] = []
    size = 0
    for entry in reversed(order):
        if not groups or size + entry[1] > bucket_elements:
            groups.append([])
            size = 0
        groups[-1].append(entry)
        size += entry[1]
    groups = groups or [[]]
    buckets, hi = [], total
    for k, members in enumerate(groups):
        lo = 0 if k == len(groups) - 1 else members[-1][0]
        buckets.append(BucketSpan(lo, hi, -(-(hi - lo) // world) * world,
                                  tuple(sorted(index for _, _, index in members))))
        hi = lo
    return buckets


@dataclass(frozen=True)
class Run:
    """A contiguous flat range ``[start, start + length)`` of bucket `bucket`."""

    bucket: int
    start: int
    length: int


def runs_between(buckets: list[BucketSpan], world: int, partition_size: int, source: int,
                 dest: int) -> list[Run]:
    """The pieces of rank `source`'s bucket shards that lie in rank `dest`'s ZeRO partition
    (``[dest * partition_size, (dest + 1) * partition_size)``), in ascending flat order: what
    `source` sends `dest` and `dest` receives from `source`, in the same order on both."""
    low, high = dest * partition_size, (dest + 1) * partition_size
    runs = []
    for k in sorted(range(len(buckets)), key=lambda k: buckets[k].lo):
        start, end = buckets[k].shard(source, world)
        start, end = max(start, low), min(end, high)
        if start < end:
            runs.append(Run(k, start, end - start))
    return runs

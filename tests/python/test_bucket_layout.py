"""ZeRO 1/2's bucket layout (sdp4bit/deepspeed/bucket_layout.py) on random parameter
layouts: buckets of whole parameters in backward order tiling the flat buffer, and the
all-to-all's pieces covering every partition once."""

from __future__ import annotations

import random

import pytest

from sdp4bit.deepspeed.bucket_layout import plan_buckets, runs_between


def _layout(rng: random.Random, world: int) -> tuple[list[tuple[int, int]], int]:
    """Parameters of random sizes (some empty) packed from 0, then padding to a multiple of
    `world` (DeepSpeed's flat buffer), in a shuffled group order."""
    spans, offset = [], 0
    for _ in range(rng.randint(1, 12)):
        numel = rng.choice([0, 1, 7, 64, 300, 1000, 4096])
        spans.append((offset, numel))
        offset += numel
    total = max(offset, 1)
    total += -total % (world * rng.choice([1, 2, 8]))
    rng.shuffle(spans)
    return spans, total


@pytest.mark.parametrize("seed", range(40))
def test_buckets_tile_the_buffer_with_whole_parameters_in_backward_order(seed):
    rng = random.Random(seed)
    world = rng.choice([1, 2, 3, 4, 8])
    spans, total = _layout(rng, world)
    limit = rng.choice([1, 100, 1500, 5000, 10**9])
    buckets = plan_buckets(spans, total, limit, world)
    assert buckets[0].hi == total and buckets[-1].lo == 0
    for upper, lower in zip(buckets, buckets[1:]):
        assert lower.hi == upper.lo, "contiguous, highest offsets first"
    placed = sorted(k for b in buckets for k in b.params)
    assert placed == sorted(k for k, (_, n) in enumerate(spans) if n > 0)
    for bucket in buckets:
        assert bucket.padded % world == 0 and bucket.hi - bucket.lo <= bucket.padded
        assert bucket.padded - (bucket.hi - bucket.lo) < world
        sizes = [spans[k][1] for k in bucket.params]
        assert sum(sizes) <= limit or len(sizes) == 1, "over reduce_bucket_size"
        for k in bucket.params:
            offset, numel = spans[k]
            assert bucket.lo <= offset and offset + numel <= bucket.hi


@pytest.mark.parametrize("seed", range(40))
def test_pieces_cover_each_partition_once_and_each_shard_once(seed):
    rng = random.Random(100 + seed)
    world = rng.choice([1, 2, 3, 4, 8])
    spans, total = _layout(rng, world)
    buckets = plan_buckets(spans, total, rng.choice([50, 700, 5000]), world)
    partition = total // world
    for dest in range(world):
        covered = []
        for source in range(world):
            runs = runs_between(buckets, world, partition, source, dest)
            for run in runs:
                start, end = buckets[run.bucket].shard(source, world)
                assert start <= run.start and run.start + run.length <= end, "not source's"
            positions = [p for run in runs for p in range(run.start, run.start + run.length)]
            assert positions == sorted(positions), "ascending, the same order on both ends"
            covered += positions
        assert sorted(covered) == list(range(dest * partition, (dest + 1) * partition))
    for source in range(world):
        sent = sorted(p for dest in range(world)
                      for run in runs_between(buckets, world, partition, source, dest)
                      for p in range(run.start, run.start + run.length))
        held = sorted(p for b in buckets for p in range(*b.shard(source, world)))
        assert sent == held, "every element of the source's shards goes somewhere, once"


def test_a_bucket_size_that_is_not_positive_is_refused():
    with pytest.raises(ValueError, match="reduce_bucket_size must be positive"):
        plan_buckets([(0, 10)], 10, 0, 2)

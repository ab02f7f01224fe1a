"""Rank code of bench/cluster.py: times one bucket's gradient reduce-scatter and parameter
all-gather for each preset, and the uncompressed torch.distributed collectives, over the
gloo group of the emulated cluster (launched with RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
MASTER_ADDR and MASTER_PORT set). Rank 0 writes a JSON list of rows to --out."""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist

from sdp4bit import Config, GradReduceScatter, ProcessGroups, WeightAllGather


def slowest(seconds: float) -> float:
    """The slowest rank's time: the collective is done when every rank is."""
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def timed(run, reps: int) -> float:
    """Median over `reps` of the slowest rank's time of `run()`, after one warm-up."""
    run()
    times = []
    for _ in range(reps):
        dist.barrier()
        start = time.perf_counter()
        run()
        times.append(slowest(time.perf_counter() - start))
    return sorted(times)[len(times) // 2]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--numel", type=int, default=1 << 22)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--presets", default="sdp4bit,qsdp,global-qsgd,zeropp")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    numel = args.numel - args.numel % world
    groups = ProcessGroups.create(local_world_size=int(os.environ["LOCAL_WORLD_SIZE"]))
    g = torch.Generator().manual_seed(rank)
    grads = torch.randn(numel, generator=g) * 1e-3
    params = torch.randn(numel, generator=torch.Generator().manual_seed(7)).bfloat16()
    shard_len = numel // world
    rows = []

    shard = torch.empty(shard_len)
    bits = params.view(torch.int16)
    words = bits.view(torch.int32)  # gloo has no 16-bit collectives: the same bytes as int32
    mine = words[rank * shard_len // 2:(rank + 1) * shard_len // 2].clone()
    rs_s = timed(lambda: dist.reduce_scatter_tensor(shard, grads.clone()), args.reps)
    ag_s = timed(lambda: dist.all_gather_into_tensor(words, mine), args.reps)
    # The uncompressed bytes as the core counts them (fp32 reduce-scatter, bf16 all-gather).
    uncompressed = Config("baseline")
    rows.append({"preset": "baseline", "rs_s": rs_s, "ag_s": ag_s,
                 "rs_bytes": GradReduceScatter(groups, uncompressed, numel, 4000)
                 .baseline_wire_bytes().total,
                 "ag_bytes": WeightAllGather(groups, uncompressed, params.clone(), 4000)
                 .baseline_wire_bytes().total})

    for bucket_id, preset in enumerate(args.presets.split(",")):
        config = Config(preset)
        rs = GradReduceScatter(groups, config, numel, bucket_id)
        ag = WeightAllGather(groups, config, params.clone(), bucket_id)
        local_params = params.clone()
        step = [0]

        def reduce_scatter():
            rs.start(grads.clone(), shard, step[0]).wait()
            step[0] += 1

        def all_gather():
            local_params[rank * shard_len:(rank + 1) * shard_len] += 1e-3
            ag.start(local_params, step[0]).wait()
            step[0] += 1

        rs_s = timed(reduce_scatter, args.reps)
        ag_s = timed(all_gather, args.reps)
        rows.append({"preset": preset, "rs_s": rs_s, "ag_s": ag_s,
                     "rs_bytes": rs.wire_bytes(1).total, "ag_bytes": ag.wire_bytes().total})
    groups.close()
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({"numel": numel, "world": world, "rows": rows}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

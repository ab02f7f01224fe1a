"""Rank code of bench/cluster.py: times one bucket's gradient reduce-scatter and parameter
all-gather for each preset, and the uncompressed torch.distributed collectives (gloo's
reduce-scatter, and one built from an all-to-all and a local sum), over the
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


def timed(run, reps: int) -> dict:
    """The slowest rank's time of `run()` over `reps` runs after one warm-up: median, min and
    max in seconds."""
    run()
    times = []
    for _ in range(reps):
        dist.barrier()
        start = time.perf_counter()
        run()
        times.append(slowest(time.perf_counter() - start))
    times.sort()
    return {"median": times[len(times) // 2], "min": times[0], "max": times[-1]}


def reduce_scatter_by_all_to_all(shard: torch.Tensor, grads: torch.Tensor) -> None:
    """An uncompressed reduce-scatter that sends each byte once (direct send): an all-to-all
    of the W blocks, then this rank's sum of the W blocks it received."""
    world = dist.get_world_size()
    blocks = torch.empty_like(grads)
    dist.all_to_all_single(blocks, grads)
    torch.sum(blocks.view(world, -1), dim=0, out=shard)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--numel", type=int, default=1 << 22)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--presets", default="sdp4bit,qsdp,global-qsgd,zeropp")
    p.add_argument("--knobs", default="",
                   help="knob overrides for every preset, e.g. pipeline_chunks=1")
    p.add_argument("--phase-log", default="",
                   help="a directory: the core logs each call's phase times there")
    p.add_argument("--skip-baseline", action="store_true",
                   help="time the presets only (the phase runs)")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    if args.phase_log:
        os.environ["SDP4BIT_PHASE_LOG"] = args.phase_log  # read when a bucket is planned
    knobs = dict(kv.split("=") for kv in args.knobs.split(",") if kv)
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
    def gloo_rs():
        dist.reduce_scatter_tensor(shard, grads.clone())

    def gloo_ag():
        dist.all_gather_into_tensor(words, mine)

    def a2a_rs():
        reduce_scatter_by_all_to_all(shard, grads.clone())

    # The uncompressed bytes as the core counts them (fp32 reduce-scatter, bf16 all-gather).
    uncompressed = Config("baseline")
    if not args.skip_baseline:
        rows.append({"preset": "baseline", "rs": timed(gloo_rs, args.reps),
                     "ag": timed(gloo_ag, args.reps),
                     "comm": timed(lambda: (gloo_rs(), gloo_ag()), args.reps),
                     "rs_a2a": timed(a2a_rs, args.reps),
                     "comm_a2a": timed(lambda: (a2a_rs(), gloo_ag()), args.reps),
                     "rs_bytes": GradReduceScatter(groups, uncompressed, numel, 4000)
                     .baseline_wire_bytes().total,
                     "ag_bytes": WeightAllGather(groups, uncompressed, params.clone(), 4000)
                     .baseline_wire_bytes().total})

    for bucket_id, preset in enumerate(args.presets.split(",")):
        config = Config.from_knobs(preset, knobs)
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

        rows.append({"preset": preset, "rs": timed(reduce_scatter, args.reps),
                     "ag": timed(all_gather, args.reps),
                     "comm": timed(lambda: (reduce_scatter(), all_gather()), args.reps),
                     "rs_bytes": rs.wire_bytes(1).total, "ag_bytes": ag.wire_bytes().total})
    groups.close()
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({"numel": numel, "world": world, "rows": rows}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

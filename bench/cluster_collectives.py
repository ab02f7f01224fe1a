"""Rank code of bench/cluster.py: times one bucket's gradient reduce-scatter and parameter
all-gather for each preset, and the uncompressed torch.distributed collectives (gloo's
reduce-scatter, and one built from an all-to-all and a local sum), over the
gloo group of the emulated cluster (launched with RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
MASTER_ADDR and MASTER_PORT set). Rank 0 writes a JSON list of rows to --out."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time

import torch
import torch.distributed as dist

from sdp4bit import Config, GradReduceScatter, ProcessGroups, WeightAllGather


def slowest(seconds: float) -> float:
    """The slowest rank's time: the collective is done when every rank is."""
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def timed(run, reps: int, prepare=lambda: None) -> dict:
    """The slowest rank's time of `run()` over `reps` runs after one warm-up, each after an
    untimed `prepare()` (what the caller does between two calls: refilling an input the
    collective consumes, the optimizer's update of the own shard): median, min and max in
    seconds."""
    prepare()
    run()
    times = []
    for _ in range(reps):
        prepare()
        dist.barrier()
        start = time.perf_counter()
        run()
        times.append(slowest(time.perf_counter() - start))
    times.sort()
    return {"median": times[len(times) // 2], "min": times[0], "max": times[-1]}


def thread_times() -> dict:
    """Per thread of this process: (name, ns on a CPU, ns runnable but waiting for one), from
    /proc/self/task/*/schedstat (nanosecond accounting, unlike utime's clock ticks)."""
    out = {}
    for task in os.scandir("/proc/self/task"):
        try:
            with open(f"{task.path}/comm") as f:
                name = f.read().strip()
            with open(f"{task.path}/schedstat") as f:
                on_cpu, waiting, _ = (int(x) for x in f.read().split())
        except OSError:  # the thread ended meanwhile
            continue
        out[int(task.name)] = (name, on_cpu, waiting)
    return out


def machine_times() -> list[int]:
    """The machine's CPU time by kind (/proc/stat's first line, clock ticks): user, nice,
    system, idle, iowait, irq, softirq, steal."""
    with open("/proc/stat") as f:
        return [int(x) for x in f.readline().split()[1:9]]


def minor_faults() -> int:
    """This process's minor page faults so far (/proc/self/stat's tenth field)."""
    with open("/proc/self/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[7])


def link_bytes() -> tuple[int, int] | None:
    """(sent, received) bytes so far on this node's link to the other nodes (the interface
    gloo uses, GLOO_SOCKET_IFNAME; the node's ranks reach each other over loopback), or None
    outside the emulated cluster."""
    iface = os.environ.get("GLOO_SOCKET_IFNAME")
    if not iface:
        return None
    try:
        return tuple(int(open(f"/sys/class/net/{iface}/statistics/{kind}_bytes").read())
                     for kind in ("tx", "rx"))
    except OSError:
        return None


def thread_group(tid: int, name: str) -> str:
    """The accounting group of a thread: the Python thread that calls start()/wait(), the
    core's pass pool, or the rest (the extension's executor thread, gloo's and torch's)."""
    if tid == os.getpid():
        return "main"
    if name.startswith("sdp4bit-pass"):
        return "pass_pool"
    return "executor_gloo_other"


def cpu_accounting(run, reps: int, prepare=lambda: None) -> dict:
    """Runs `run()` `reps` times after one warm-up, each after an untimed `prepare()` and a
    barrier, and returns this rank's wall time per call and its threads' CPU and run-queue
    wait per call by group, with the machine's CPU time by kind per call (all ms), and the
    bytes per call its node's link sent and received (every rank of the node counts the
    node's traffic; None outside the emulated cluster)."""
    prepare()
    run()
    own = threading.get_native_id()
    wall = 0.0
    groups: dict = {}
    machine = [0] * 8
    faults = 0
    link = [0, 0]
    for _ in range(reps):
        prepare()
        dist.barrier()
        f0, before, m0, l0 = minor_faults(), thread_times(), machine_times(), link_bytes()
        own0 = time.thread_time_ns()
        start = time.perf_counter()
        run()
        wall += time.perf_counter() - start
        own1 = time.thread_time_ns()
        after, m1, l1 = thread_times(), machine_times(), link_bytes()
        if l0 is not None and l1 is not None:
            link = [a + b - c for a, b, c in zip(link, l1, l0)]
        faults += minor_faults() - f0
        machine = [a + b - c for a, b, c in zip(machine, m1, m0)]
        for tid, (name, on_cpu, waiting) in after.items():
            _, cpu0, wait0 = before.get(tid, (name, 0, 0))
            if tid == own:
                # A thread's schedstat is brought up to date only when it is switched out, so
                # this thread's would count the snapshots' own reading (about 1 ms of CPU for
                # a rank's 30-odd threads, as much as the calls it measures): its own CPU
                # clock, read just around run(), instead.
                cpu0, on_cpu = own0, own1
            g = groups.setdefault(thread_group(tid, name), {"cpu_ms": 0.0, "runqueue_ms": 0.0,
                                                            "threads": set()})
            g["cpu_ms"] += (on_cpu - cpu0) / 1e6 / reps
            g["runqueue_ms"] += (waiting - wait0) / 1e6 / reps
            if on_cpu > cpu0:
                g["threads"].add(tid)
    tick_ms = 1e3 / os.sysconf("SC_CLK_TCK")
    kinds = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")
    return {"wall_ms": wall * 1e3 / reps, "minor_faults": faults / reps,
            "groups": {k: {**v, "threads": len(v["threads"])} for k, v in groups.items()},
            "machine_ms": {k: v * tick_ms / reps for k, v in zip(kinds, machine)},
            "link_bytes": None if link_bytes() is None else {
                "sent": link[0] / reps, "received": link[1] / reps}}


def call_latency(groups: ProcessGroups, reps: int) -> dict:
    """Median time per call (ms) of the fixed costs: an all-to-all of 4 bytes per peer through
    torch.distributed on each of sdp4bit's groups, and sdp4bit's reduce-scatter and all-gather
    of a bucket of 1024 elements per rank (Python, the executor thread and its exchanges)."""
    def median_ms(run) -> float:
        run()
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            run()
            times.append(time.perf_counter() - start)
        return statistics.median(times) * 1e3

    out = {}
    for name in ("world", "intra", "inter"):
        group = getattr(groups, name)
        if group is None:
            continue
        size = dist.get_world_size(group)
        send, recv = torch.zeros(size), torch.empty(size)
        dist.barrier()
        out[f"a2a_{name}_ms"] = median_ms(lambda: dist.all_to_all_single(recv, send, group=group))
    world = dist.get_world_size()
    numel = 1024 * world
    config = Config("sdp4bit")
    os.environ.pop("SDP4BIT_PHASE_LOG", None)  # the phase logs hold the bucket's calls only
    rs = GradReduceScatter(groups, config, numel, 4090)
    ag = WeightAllGather(groups, config, torch.zeros(numel, dtype=torch.bfloat16), 4091)
    grads, shard = torch.randn(numel), torch.empty(numel // world)
    params = torch.zeros(numel, dtype=torch.bfloat16)
    dist.barrier()
    out["sdp4bit_rs_tiny_ms"] = median_ms(lambda: rs.start(grads, shard, 1).wait())
    dist.barrier()
    out["sdp4bit_ag_tiny_ms"] = median_ms(lambda: ag.start(params, 1).wait())
    return out


def reduce_scatter_by_all_to_all(shard: torch.Tensor, grads: torch.Tensor,
                                 blocks: torch.Tensor) -> None:
    """An uncompressed reduce-scatter that sends each byte once (direct send): an all-to-all
    of the W blocks into `blocks` (kept by the caller, as grads' size), then this rank's sum
    of the W blocks it received."""
    world = dist.get_world_size()
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
    p.add_argument("--cpu-log", default="",
                   help="a directory: each rank writes its CPU accounting of the presets' "
                   "reduce-scatter + all-gather there (rank<z>.json)")
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
    cpu_rows = {}

    shard = torch.empty(shard_len)
    bits = params.view(torch.int16)
    words = bits.view(torch.int32)  # gloo has no 16-bit collectives: the same bytes as int32
    mine = words[rank * shard_len // 2:(rank + 1) * shard_len // 2].clone()
    # Inputs and outputs live across calls, as a framework's buckets do: a tensor allocated
    # per call would time its page faults (a fresh 16 MiB costs ~3.5 ms of CPU here), and
    # the input is refilled untimed in case gloo's reduce-scatter reuses it as scratch.
    rs_input, blocks = grads.clone(), torch.empty_like(grads)

    def refill_input():
        rs_input.copy_(grads)

    def gloo_rs():
        dist.reduce_scatter_tensor(shard, rs_input)

    def gloo_ag():
        dist.all_gather_into_tensor(words, mine)

    def a2a_rs():
        reduce_scatter_by_all_to_all(shard, rs_input, blocks)

    # The uncompressed bytes as the core counts them (fp32 reduce-scatter, bf16 all-gather).
    uncompressed = Config("baseline")
    if not args.skip_baseline:
        rows.append({"preset": "baseline", "rs": timed(gloo_rs, args.reps, refill_input),
                     "ag": timed(gloo_ag, args.reps),
                     "comm": timed(lambda: (gloo_rs(), gloo_ag()), args.reps, refill_input),
                     "rs_a2a": timed(a2a_rs, args.reps, refill_input),
                     "comm_a2a": timed(lambda: (a2a_rs(), gloo_ag()), args.reps,
                                       refill_input),
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

        def reduce_scatter():  # the core reads the bucket only
            rs.start(grads, shard, step[0]).wait()
            step[0] += 1

        def update_own_shard():  # the optimizer's step, between two all-gathers
            local_params[rank * shard_len:(rank + 1) * shard_len] += 1e-3

        def all_gather():
            ag.start(local_params, step[0]).wait()
            step[0] += 1

        def both():
            reduce_scatter()
            all_gather()

        rows.append({"preset": preset, "rs": timed(reduce_scatter, args.reps),
                     "ag": timed(all_gather, args.reps, update_own_shard),
                     "comm": timed(both, args.reps, update_own_shard),
                     "rs_bytes": rs.wire_bytes(1).total, "ag_bytes": ag.wire_bytes().total})
        if args.cpu_log:
            cpu_rows[preset] = cpu_accounting(both, args.reps, update_own_shard)
    if args.cpu_log:
        if not args.skip_baseline:
            cpu_rows["baseline"] = cpu_accounting(lambda: (gloo_rs(), gloo_ag()), args.reps,
                                                  refill_input)
        cpu_rows["latency"] = call_latency(groups, 30)
        with open(os.path.join(args.cpu_log, f"rank{rank}.json"), "w") as f:
            json.dump(cpu_rows, f)
    groups.close()
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({"numel": numel, "world": world, "rows": rows}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

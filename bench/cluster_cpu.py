"""The CPU work of one bucket's reduce-scatter + all-gather on the emulated cluster, per preset
(the uncompressed gloo collectives included), topology, link rate and rank: each rank's CPU
time per call summed over its threads (the scheduler's nanosecond accounting, which other
load on the machine does not inflate as it does wall time) and the machine's busy time per
call, the inputs of the cost model's CPU term (bench/calibrate_plan.py); beside them, the
same run's timing of the collectives and the link time of their bytes, as bench/cluster.py
measures them (without its training steps).

    sudo bash scripts/bench.sh cluster_cpu --topologies 2x2,4x1 --rates-mbit 1000,10000 \\
        --sweeps 3 --out bench/results/cluster_cpu.json

Needs root and iproute2, as bench/cluster.py."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cluster import ROOT, link_ms, run_ranks  # noqa: E402
from netns import Cluster, ClusterUnavailable, Link, check_host  # noqa: E402

PRESETS = "sdp4bit,qsdp,global-qsgd,zeropp"


def measure(topology: str, rate: float, args, workdir: Path) -> list[dict]:
    """One row per preset (baseline first): the slowest rank's RS + AG time (median, min and
    max of --reps runs, as bench/cluster.py times it) and the link time of its bytes (the
    core's plan); the bytes per call on the busiest node link in either direction, as its
    interface counted them (headers included, what the link's shaping meters); every
    rank's CPU ms per RS + AG in --reps further runs, their median and sum, and the machine's
    user + system + irq ms per call (median over the ranks' views)."""
    nodes, per_node = (int(x) for x in topology.split("x"))
    logs = workdir / f"cpu-{topology}-{rate:g}"
    logs.mkdir(parents=True)
    timings = logs / "collectives.json"
    with Cluster(nodes, Link(rate, 0.0)) as cluster:
        run_ranks(cluster, per_node, [
            str(ROOT / "bench/cluster_collectives.py"), "--numel", str(args.numel),
            "--reps", str(args.reps), "--presets", args.presets, "--cpu-log", str(logs),
            "--out", str(timings)], 29403, args.timeout)
    collectives = json.loads(timings.read_text())
    timed = {r["preset"]: r["comm"] for r in collectives["rows"]}
    ranks = [json.loads(p.read_text()) for p in sorted(logs.glob("rank*.json"),
                                                       key=lambda p: int(p.stem[4:]))]
    rows = []
    for preset in ["baseline", *args.presets.split(",")]:
        per_rank = [sum(g["cpu_ms"] for g in r[preset]["groups"].values()) for r in ranks]
        machine = [r[preset]["machine_ms"] for r in ranks]
        rows.append({
            "topology": topology, "rate_mbit": rate, "preset": preset,
            "rank_cpu_ms": per_rank, "rank_cpu_median_ms": statistics.median(per_rank),
            "group_cpu_ms": {g: statistics.median(r[preset]["groups"].get(g, {"cpu_ms": 0.0})
                                                  ["cpu_ms"] for r in ranks)
                             for g in ("main", "pass_pool", "executor_gloo_other")},
            "ranks_cpu_ms": sum(per_rank),
            "bucket_numel": collectives["numel"],
            "link_ms": link_ms(preset, collectives["numel"], nodes, per_node, rate),
            "wire_bytes": max(max(r[preset]["link_bytes"].values()) for r in ranks),
            "comm_ms": timed[preset]["median"] * 1e3, "comm_min_ms": timed[preset]["min"] * 1e3,
            "comm_max_ms": timed[preset]["max"] * 1e3,
            "wall_ms": statistics.median(r[preset]["wall_ms"] for r in ranks),
            "machine_busy_ms": statistics.median(
                m["user"] + m["nice"] + m["system"] + m["irq"] + m["softirq"] for m in machine),
            "machine_idle_ms": statistics.median(m["idle"] for m in machine)})
    return rows


def combine(runs: list[list[dict]]) -> list[dict]:
    """One row per topology, rate and preset from the sweeps in `runs`: the median over the
    sweeps of the timing's median (`comm_ms`) with the min and max of the sweeps' medians
    (`sweep_min_ms`, `sweep_max_ms`: the spread between runs) and over every timed call, and
    the median over the sweeps of the mean CPU ms per rank (`cpu_ms`) and of the busiest link's
    bytes per call (`wire_bytes`); every sweep's own row under `runs`."""
    out = []
    for rows in zip(*runs):
        first = rows[0]
        out.append({
            **{k: first[k] for k in ("topology", "rate_mbit", "preset", "bucket_numel",
                                     "link_ms")},
            "wire_bytes": statistics.median(r["wire_bytes"] for r in rows),
            "comm_ms": statistics.median(r["comm_ms"] for r in rows),
            "comm_min_ms": min(r["comm_min_ms"] for r in rows),
            "comm_max_ms": max(r["comm_max_ms"] for r in rows),
            "sweep_min_ms": min(r["comm_ms"] for r in rows),
            "sweep_max_ms": max(r["comm_ms"] for r in rows),
            "cpu_ms": statistics.median(r["ranks_cpu_ms"] / len(r["rank_cpu_ms"])
                                        for r in rows),
            "runs": list(rows)})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--topologies", default="2x2,4x1")
    p.add_argument("--rates-mbit", default="1000,10000")
    p.add_argument("--presets", default=PRESETS)
    p.add_argument("--numel", type=int, default=1 << 22)
    p.add_argument("--reps", type=int, default=5, help="timed calls per measurement")
    p.add_argument("--sweeps", type=int, default=3,
                   help="times every topology and rate is measured, one after another")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--out", default=str(ROOT / "bench/results/cluster_cpu.json"))
    args = p.parse_args()
    try:
        check_host()
    except ClusterUnavailable as error:
        raise SystemExit(f"bench/cluster_cpu.py: {error}")
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for sweep in range(args.sweeps):
            rows = []
            for topology in args.topologies.split(","):
                for rate in (float(r) for r in args.rates_mbit.split(",")):
                    print(f"== sweep {sweep + 1}: {topology} at {rate:g} Mbit/s", flush=True)
                    rows += measure(topology, rate, args, Path(tmp) / str(sweep))
            runs.append(rows)
    meta = {"date": datetime.date.today().isoformat(), "machine": platform.node(),
            "cpus": os.cpu_count(), "command": "bench/cluster_cpu.py " + " ".join(sys.argv[1:])}
    rows = combine(runs)
    Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    for r in rows:
        print(f"{r['topology']} {r['rate_mbit'] / 1000:g} Gbit/s {r['preset']:<12} comm "
              f"{r['comm_ms']:.1f} [{r['sweep_min_ms']:.1f}-{r['sweep_max_ms']:.1f}] ms, link "
              f"{r['link_ms']:.1f} ms, on the wire {r['wire_bytes'] * 8e-3 / r['rate_mbit']:.1f} "
              f"ms, CPU per rank {r['cpu_ms']:.1f} ms (sweeps: "
              + ", ".join(f"{x['ranks_cpu_ms'] / len(x['rank_cpu_ms']):.1f}" for x in r["runs"])
              + ")")


if __name__ == "__main__":
    main()

"""Where sdp4bit's time goes on the emulated cluster: each rank's phases of the gradient
reduce-scatter and the parameter all-gather (the core's SDP4BIT_PHASE_LOG timing: passes,
exchange starts, time blocked waiting), per variant (pipeline chunks, rayon threads per rank),
topology and link rate, as a markdown table on stdout and JSON in --out; then each rank's CPU
accounting of the RS + AG (CPU and run-queue time per thread group, page faults, the machine's
CPU by kind) and the fixed costs per call (tiny all-to-alls per group, tiny sdp4bit calls).

    python bench/cluster_phases.py --topologies 2x2,4x1 --rates-mbit 1000,10000 \\
        --variants "pipeline_chunks=1;pipeline_chunks=1,threads=1;threads=1"

A variant is `knob=value` pairs for the config plus `threads=N` (RAYON_NUM_THREADS of every
rank); the empty variant is the defaults (automatic chunks; the passes' pool of the machine's
cores divided by all ranks, bench/cluster.py's run_ranks, since the emulated nodes share the
machine)."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cluster import ROOT, run_ranks  # noqa: E402
from netns import Cluster, ClusterUnavailable, Link, check_host  # noqa: E402

PHASES = ("first_pass", "first_start", "first_wait", "second_pass", "second_start",
          "second_wait", "last_pass")


def parse_variant(text: str) -> tuple[str, dict]:
    """(knobs for --knobs, extra environment) of one variant."""
    knobs, env = [], {}
    for item in filter(None, text.split(",")):
        key, value = item.split("=")
        if key == "threads":
            env["RAYON_NUM_THREADS"] = value
        else:
            knobs.append(item)
    return ",".join(knobs), env


def medians(log: Path) -> dict:
    """Median over the calls in one rank's log of every phase and the total, in ms."""
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    keys = ["total_ms", *(f"{p}_ms" for p in PHASES)]
    out = {k: statistics.median(c[k] for c in calls) for k in keys}
    out["chunks"] = calls[0]["chunks"]
    out["calls"] = len(calls)
    return out


def measure(topology: str, rate: float, variant: str, args, workdir: Path) -> list[dict]:
    nodes, per_node = (int(x) for x in topology.split("x"))
    knobs, env = parse_variant(variant)
    logs = workdir / f"phases-{topology}-{rate}-{abs(hash(variant))}"
    logs.mkdir()
    cpu_logs = logs / "cpu"
    cpu_logs.mkdir()
    with Cluster(nodes, Link(rate, 0.0)) as cluster:
        run_ranks(cluster, per_node, [
            str(ROOT / "bench/cluster_collectives.py"), "--numel", str(args.numel),
            "--reps", str(args.reps), "--presets", "sdp4bit", "--skip-baseline",
            "--knobs", knobs, "--phase-log", str(logs), "--cpu-log", str(cpu_logs),
            "--out", str(workdir / "coll.json")], 29402, args.timeout, env)
    rows = []
    for log in sorted(cpu_logs.glob("rank*.json")):
        rank = int(log.stem.removeprefix("rank"))
        data = json.loads(log.read_text())
        CPU_ROWS.append({"topology": topology, "rate_mbit": rate,
                         "variant": variant or "defaults", "rank": rank,
                         **data["sdp4bit"], "latency": data["latency"]})
    for log in sorted(logs.glob("*.jsonl")):
        kind, _, rank = log.stem.split("-")
        rows.append({"topology": topology, "rate_mbit": rate, "variant": variant or "defaults",
                     "collective": kind, "rank": int(rank.removeprefix("rank")),
                     **medians(log)})
    return rows


# Each rank's CPU accounting of sdp4bit's reduce-scatter + all-gather (cluster_collectives'
# --cpu-log), filled by measure().
CPU_ROWS: list[dict] = []

GROUPS = ("main", "pass_pool", "executor_gloo_other")


def cpu_table(rows: list[dict]) -> str:
    """Per rank: wall ms of RS + AG, each thread group's ms on a CPU and ms runnable but
    waiting for one, the machine's busy / softirq / idle ms in the same calls (all per call),
    and the fixed costs per call (tiny all-to-alls, tiny sdp4bit collectives)."""
    head = ["topology", "link", "variant", "rank", "wall ms",
            *(f"{g} cpu / runq ms" for g in GROUPS), "rank cpu ms", "page faults",
            "machine user+sys / softirq / idle ms", "a2a world / intra / inter ms",
            "tiny RS / AG ms"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in sorted(rows, key=lambda r: (r["topology"], r["rate_mbit"], r["variant"],
                                         r["rank"])):
        g = r["groups"]
        m = r["machine_ms"]
        lat = r["latency"]
        cells = [r["topology"], f"{r['rate_mbit'] / 1000:g} Gbit/s", r["variant"],
                 str(r["rank"]), f"{r['wall_ms']:.1f}"]
        for name in GROUPS:
            x = g.get(name, {"cpu_ms": 0.0, "runqueue_ms": 0.0})
            cells.append(f"{x['cpu_ms']:.1f} / {x['runqueue_ms']:.1f}")
        cells.append(f"{sum(x['cpu_ms'] for x in g.values()):.1f}")
        cells.append(f"{r['minor_faults']:.0f}")
        cells.append(f"{m['user'] + m['nice'] + m['system']:.0f} / {m['softirq']:.0f} / "
                     f"{m['idle']:.0f}")
        cells.append(" / ".join(f"{lat[k]:.2f}" if k in lat else "-"
                                for k in ("a2a_world_ms", "a2a_intra_ms", "a2a_inter_ms")))
        cells.append(f"{lat['sdp4bit_rs_tiny_ms']:.2f} / {lat['sdp4bit_ag_tiny_ms']:.2f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def table(rows: list[dict]) -> str:
    head = ["topology", "link", "variant", "collective", "rank", "P", "total ms",
            *(f"{p} ms" for p in PHASES)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in sorted(rows, key=lambda r: (r["topology"], r["rate_mbit"], r["variant"],
                                         r["collective"], r["rank"])):
        lines.append("| " + " | ".join([
            r["topology"], f"{r['rate_mbit'] / 1000:g} Gbit/s", r["variant"], r["collective"],
            str(r["rank"]), str(r["chunks"]), f"{r['total_ms']:.1f}",
            *(f"{r[f'{p}_ms']:.1f}" for p in PHASES)]) + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--topologies", default="2x2,4x1")
    p.add_argument("--rates-mbit", default="1000,10000")
    p.add_argument("--variants", default=";threads=1;pipeline_chunks=1",
                   help="semicolon-separated variants (see the module doc)")
    p.add_argument("--numel", type=int, default=1 << 22)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--out", default=str(ROOT / "bench/results/cluster_phases.json"))
    args = p.parse_args()
    try:
        check_host()
    except ClusterUnavailable as error:
        raise SystemExit(f"bench/cluster_phases.py: {error}")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for topology in args.topologies.split(","):
            for rate in (float(r) for r in args.rates_mbit.split(",")):
                for variant in args.variants.split(";"):
                    print(f"== {topology} at {rate:g} Mbit/s, {variant or 'defaults'}",
                          flush=True)
                    rows += measure(topology, rate, variant, args, Path(tmp))
    Path(args.out).write_text(json.dumps({"phases": rows, "cpu": CPU_ROWS}, indent=1))
    print(table(rows))
    print()
    print(cpu_table(CPU_ROWS))


if __name__ == "__main__":
    main()

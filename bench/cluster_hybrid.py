"""Hybrid sharding on the emulated cluster: megatron-core's partial distributed optimizer
(``--instances`` groups of DP ranks, each sharding the model, the gradient shards all-reduced
across them) trained by examples/gpt_cpu/train.py with Megatron's own collectives and with
sdp4bit (the all-reduce across the instances as Global-QSGD integers, docs/numerics.md §7.6).
Per preset: the step time (median of the steady steps, over --reps runs, with their spread)
and the bytes the busiest node link carries per step in either direction, read from the
links' interface counters as the difference between a run of --steps steps and one of
--short-steps, so that set-up traffic cancels. Needs root (bench/netns.py).

    bash scripts/bench.sh cluster_hybrid --nodes 4 --ranks-per-node 1 --instances 2 \\
        --rate-mbit 1000 --out bench/results

Every emulated node shares this machine's cores: with 4 ranks on 2 cores the harness is
CPU-bound, and the step times say as much about the CPU as about the links; the link bytes do
not depend on it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from cluster import run_ranks  # noqa: E402
from convergence import cpu_model  # noqa: E402
from netns import NODE_IFACE, Cluster, Link  # noqa: E402

#: The study's rows: name, train.py's collectives.
PRESETS = {"megatron": ("--preset", "megatron"), "sdp4bit": ("--preset", "sdp4bit")}


def link_counters(cluster: Cluster) -> list[tuple[int, int]]:
    """Each node's (transmitted, received) bytes on its link."""
    counters = []
    for node in range(cluster.nodes):
        pair = []
        for kind in ("tx", "rx"):
            out = subprocess.run(["ip", "netns", "exec", cluster.namespace(node), "cat",
                                  f"/sys/class/net/{NODE_IFACE}/statistics/{kind}_bytes"],
                                 capture_output=True, text=True, check=True).stdout
            pair.append(int(out))
        counters.append(tuple(pair))
    return counters


def train(cluster: Cluster, args, preset: str, steps: int, workdir: Path,
          run: int) -> tuple[dict, list[tuple[int, int]]]:
    """One training run of `steps` steps; returns train.py's JSON and each node's link bytes
    (transmitted, received) during it."""
    json_out = workdir / f"{preset}-{steps}-{run}.json"
    before = link_counters(cluster)
    run_ranks(cluster, args.ranks_per_node, [
        str(ROOT / "examples/gpt_cpu/train.py"), *PRESETS[preset],
        "--instances", str(args.instances), "--ranks-per-node", str(args.ranks_per_node),
        "--steps", str(steps), "--log-every", "1000000", "--telemetry-interval", "0",
        "--val-tokens", "4096", "--json-out", str(json_out), *args.model.split()],
        29405, args.timeout)
    after = link_counters(cluster)
    moved = [(a[0] - b[0], a[1] - b[1]) for a, b in zip(after, before)]
    return json.loads(json_out.read_text()), moved


def busiest(per_step: list[tuple[float, float]]) -> float:
    """The most bytes any node link carried in one direction."""
    return max(max(pair) for pair in per_step)


def measure(args, workdir: Path) -> list[dict]:
    rows = []
    with Cluster(args.nodes, Link(args.rate_mbit, 0.0)) as cluster:
        for preset in PRESETS:
            _, short = train(cluster, args, preset, args.short_steps, workdir, 0)
            step_ms, per_step, sent = [], None, None
            for run in range(args.reps):
                trained, long = train(cluster, args, preset, args.steps, workdir, run)
                steady = sorted(trained["step_ms"][args.warmup_steps:])
                step_ms.append(statistics.median(steady))
                extra = args.steps - args.short_steps
                if per_step is None:
                    per_step = [((lt - st) / extra, (lr - sr) / extra)
                                for (lt, lr), (st, sr) in zip(long, short)]
                    sent = trained["sent"] // args.steps if trained["sent"] else None
            rows.append({"preset": preset, "step_ms": statistics.median(step_ms),
                         "step_ms_min": min(step_ms), "step_ms_max": max(step_ms),
                         "busiest_link_bytes": busiest(per_step),
                         "node_link_bytes": per_step, "sent_per_step": sent})
    return rows


def write_results(rows: list[dict], args, out_dir: Path) -> None:
    command = "bash scripts/bench.sh cluster_hybrid " + " ".join(
        shlex.quote(a) for a in sys.argv[1:])
    by = {r["preset"]: r for r in rows}
    base, ours = by["megatron"], by["sdp4bit"]
    meta = {"date": datetime.date.today().isoformat(), "command": command,
            "machine": f"{os.cpu_count()} cores, {cpu_model()}, Python "
                       f"{platform.python_version()}",
            "nodes": args.nodes, "ranks_per_node": args.ranks_per_node,
            "instances": args.instances, "rate_mbit": args.rate_mbit, "model": args.model}
    (out_dir / "cluster_hybrid.json").write_text(json.dumps({"meta": meta, "rows": rows},
                                                            indent=1))
    lines = [
        "# Hybrid sharding on the emulated cluster",
        "",
        f"- command: `{command}` ({meta['date']})",
        f"- machine: {meta['machine']}",
        f"- layout: {args.nodes} nodes x {args.ranks_per_node} ranks, {args.instances} "
        f"distributed-optimizer instances; links {args.rate_mbit:g} Mbit/s each way; model "
        f"`{args.model}`",
        "- megatron: megatron-core's own partial distributed optimizer (fp32 reduce-scatter in "
        "the instance, fp32 all-reduce across); sdp4bit: the sdp4bit preset, the all-reduce "
        "across instances as Global-QSGD's 8-bit integers (cross_group_bits=8)",
        f"- step time: the median of the steady steps (after {args.warmup_steps}) of a run, "
        f"median [min, max] over {args.reps} runs; the {args.nodes * args.ranks_per_node} "
        f"ranks share {os.cpu_count()} cores, so the harness is CPU-bound",
        f"- link bytes: per step, (bytes of a {args.steps}-step run - bytes of a "
        f"{args.short_steps}-step run) / {args.steps - args.short_steps}, the busiest node "
        "link's busier direction, from its interface counters",
        "",
        "| preset | step ms | busiest link B/step | sent by rank 0 B/step |",
        "|---|---:|---:|---:|",
    ]
    for r in rows:
        sent = f"{r['sent_per_step']:,d}" if r["sent_per_step"] else "-"
        lines.append(f"| {r['preset']} | {r['step_ms']:.0f} [{r['step_ms_min']:.0f}, "
                     f"{r['step_ms_max']:.0f}] | {r['busiest_link_bytes']:,.0f} | {sent} |")
    lines += ["",
              f"sdp4bit / megatron: step time {ours['step_ms'] / base['step_ms']:.2f}x, "
              f"busiest link bytes {ours['busiest_link_bytes'] / base['busiest_link_bytes']:.3f}x "
              f"({base['busiest_link_bytes'] / ours['busiest_link_bytes']:.2f}x fewer).", ""]
    (out_dir / "cluster_hybrid.md").write_text("\n".join(lines))
    print("\n".join(lines))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--ranks-per-node", type=int, default=1)
    p.add_argument("--instances", type=int, default=2)
    p.add_argument("--rate-mbit", type=float, default=1000)
    p.add_argument("--steps", type=int, default=10, help="steps of the timed runs")
    p.add_argument("--short-steps", type=int, default=3,
                   help="steps of the run whose link bytes are subtracted")
    p.add_argument("--warmup-steps", type=int, default=2)
    p.add_argument("--reps", type=int, default=3, help="timed runs per preset")
    p.add_argument("--model", default="--width 128 --layers 2 --batch 8 --context 64 "
                   "--corpus-bytes 1000000", help="train.py model arguments")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--out", default=str(ROOT / "bench/results"))
    args = p.parse_args()
    if args.steps <= args.short_steps:
        p.error("--steps must exceed --short-steps")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as workdir:
        rows = measure(args, Path(workdir))
    write_results(rows, args, out_dir)


if __name__ == "__main__":
    main()

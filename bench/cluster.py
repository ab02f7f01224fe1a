"""Speed on an emulated cluster: nodes as network namespaces joined by links shaped with tc
(bench/netns.py), ranks of a node inside its namespace, gloo over those links. For each
topology and link rate it measures, side by side in one run, one bucket's reduce-scatter and
all-gather per preset (bench/cluster_collectives.py) and the training step of the small GPT
(examples/gpt_cpu/train.py), and writes a table, JSON and a PNG plot.

    sudo bash scripts/bench.sh cluster --topologies 2x2,4x1 --rates-mbit 1000,10000 \
        --out bench/results

`--rescore bench/results/cluster.json` measures nothing and rewrites the results with the
current cost model's columns (after bench/calibrate_plan.py changed the model).

Needs root and iproute2 (it says so and stops otherwise); removes everything it made.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from netns import Cluster, ClusterUnavailable, Link, check_host  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def run_ranks(cluster: Cluster, per_node: int, argv: list[str], port: int, timeout: float,
              extra_env: dict | None = None) -> None:
    """Runs `argv` as every rank (ranks of node k inside namespace k) and waits for all;
    `extra_env` is added to every rank's environment.

    Every emulated node shares this machine's cores, so each rank's pass pool gets the cores
    divided by all ranks (`RAYON_NUM_THREADS`, unless `extra_env` sets it), not by its node's
    ranks as on a real cluster: with 4 one-rank nodes on 2 cores, two pass threads per rank
    made sdp4bit's RS + AG about 10-20% slower (docs/performance.md)."""
    world = cluster.nodes * per_node
    threads = str(max(1, (os.cpu_count() or 1) // world))
    procs = []
    for rank in range(world):
        env = {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank % per_node),
               "LOCAL_WORLD_SIZE": str(per_node), "MASTER_ADDR": cluster.address(0),
               "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
               "RAYON_NUM_THREADS": threads, **(extra_env or {})}
        procs.append(cluster.popen(rank // per_node, [sys.executable, *argv], env,
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    failed = []
    for rank, proc in enumerate(procs):
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise RuntimeError(f"rank {rank} of {argv[0]} ran past {timeout} s")
        if proc.returncode != 0:
            failed.append(f"--- rank {rank} (exit {proc.returncode}) ---\n{out[-3000:]}")
    if failed:
        raise RuntimeError("\n".join(failed))


def measure(topology: str, rate: float, args, workdir: Path) -> list[dict]:
    nodes, per_node = (int(x) for x in topology.split("x"))
    rows = []
    cpu_logs = workdir / f"cpu-{topology}-{rate:g}"
    cpu_logs.mkdir()
    with Cluster(nodes, Link(rate, args.delay_ms)) as cluster:
        out = workdir / f"coll-{topology}-{rate}.json"
        run_ranks(cluster, per_node, [str(ROOT / "bench/cluster_collectives.py"), "--numel",
                                      str(args.numel), "--reps", str(args.reps), "--presets",
                                      args.presets, "--cpu-log", str(cpu_logs), "--out",
                                      str(out)], 29400, args.timeout)
        cpu, wire = mean_cpu_ms(cpu_logs), busiest_link_bytes(cpu_logs)
        collectives = json.loads(out.read_text())
        for preset_row in collectives["rows"]:
            preset = preset_row["preset"]
            json_out = workdir / f"train-{topology}-{rate}-{preset}.json"
            run_ranks(cluster, per_node, [
                str(ROOT / "examples/gpt_cpu/train.py"),
                "--preset", "megatron" if preset == "baseline" else preset,
                "--ranks-per-node", str(per_node), "--steps", str(args.steps),
                "--log-every", "1000000", "--telemetry-interval", "0", "--val-tokens", "4096",
                "--json-out", str(json_out), *args.model.split()], 29401, args.timeout)
            trained = json.loads(json_out.read_text())
            steady = sorted(trained["step_ms"][args.warmup_steps:])
            rows.append({
                "topology": topology, "rate_mbit": rate, "delay_ms": args.delay_ms,
                "preset": preset, "bucket_numel": collectives["numel"],
                **{f"{k}_ms": preset_row[k]["median"] * 1e3 for k in ("rs", "ag", "comm")},
                "comm_min_ms": preset_row["comm"]["min"] * 1e3,
                "comm_max_ms": preset_row["comm"]["max"] * 1e3,
                "bucket_bytes": preset_row["rs_bytes"] + preset_row["ag_bytes"],
                "step_ms": steady[len(steady) // 2],
                "step_bytes": trained["sent"] // args.steps if trained["sent"] else None,
                "cpu_ms": cpu[preset], "wire_bytes": wire[preset],
            })
            if preset == "baseline":
                rows[-1].update(rs_a2a_ms=preset_row["rs_a2a"]["median"] * 1e3,
                                comm_a2a_ms=preset_row["comm_a2a"]["median"] * 1e3,
                                comm_a2a_min_ms=preset_row["comm_a2a"]["min"] * 1e3,
                                comm_a2a_max_ms=preset_row["comm_a2a"]["max"] * 1e3)
    derive(rows)
    return rows


def derive(rows: list[dict]) -> None:
    """Each row's link time (`link_ms`, from the core's plan) and its ratios to the
    measurements and to the same topology and rate's uncompressed row."""
    for r in rows:
        nodes, per_node = (int(x) for x in r["topology"].split("x"))
        r["link_ms"] = link_ms(r["preset"], r["bucket_numel"], nodes, per_node, r["rate_mbit"])
    base = {(r["topology"], r["rate_mbit"]): r for r in rows if r["preset"] == "baseline"}
    for r in rows:
        b = base[(r["topology"], r["rate_mbit"])]
        r["link_fraction"] = r["link_ms"] / r["comm_ms"]
        r["comm_speedup"] = b["comm_ms"] / r["comm_ms"]
        r["best_uncompressed_ms"] = min(b["comm_ms"], b["comm_a2a_ms"])
        r["best_speedup"] = r["best_uncompressed_ms"] / r["comm_ms"]
        r["ideal_speedup"] = b["bucket_bytes"] / r["bucket_bytes"]
        r["step_speedup"] = b["step_ms"] / r["step_ms"]


def mean_cpu_ms(cpu_logs: Path) -> dict[str, float]:
    """Per preset (baseline included), one rank's CPU per reduce-scatter + all-gather, the mean
    over the ranks' CPU accounting in `cpu_logs` (cluster_collectives' --cpu-log)."""
    ranks = [json.loads(p.read_text()) for p in cpu_logs.glob("rank*.json")]
    presets = [k for k in ranks[0] if k != "latency"]
    return {p: sum(sum(g["cpu_ms"] for g in r[p]["groups"].values()) for r in ranks)
            / len(ranks) for p in presets}


def busiest_link_bytes(cpu_logs: Path) -> dict[str, float | None]:
    """Per preset, the bytes per call on the busiest node link in either direction, as the
    links' interfaces counted them (cluster_collectives' --cpu-log; None where not counted)."""
    ranks = [json.loads(p.read_text()) for p in cpu_logs.glob("rank*.json")]
    presets = [k for k in ranks[0] if k != "latency"]
    return {p: None if any(r[p].get("link_bytes") is None for r in ranks)
            else max(max(r[p]["link_bytes"].values()) for r in ranks) for p in presets}


def link_ms(preset: str, numel: int, nodes: int, per_node: int, rate_mbit: float) -> float:
    """Milliseconds the busiest node link needs, at `rate_mbit` per direction, for the bytes
    one bucket's reduce-scatter and all-gather send between nodes as the core plans them
    (`sdp4bit.plan.node_link_bytes`: all-to-alls straight to their peers, all-gathers in a
    ring; uncompressed: rings, the least an uncompressed collective sends)."""
    from sdp4bit import plan

    return plan.bucket_link_ms(preset, numel, nodes, per_node, rate_mbit)


def add_predictions(rows: list[dict], cores: int) -> None:
    """The cost model (sdp4bit.plan with the constants bench/calibrate_plan.py fitted on
    bench/results/cluster_cpu.json) checked against the measurements: each row's time predicted
    from one rank's CPU per call and the bytes its busiest node link carried per call (the
    row's own accounting; for rows measured without it, bench/results/cluster_cpu.json's of
    the same topology, rate and preset)."""
    from calibrate_plan import default_constants, predict_ms, wire_ms

    constants = default_constants()
    accounted = {(r["topology"], r["rate_mbit"], r["preset"]): r for r in json.loads(
        (ROOT / "bench/results/cluster_cpu.json").read_text())["rows"]}
    for r in rows:
        source = r if r.get("cpu_ms") else accounted.get(
            (r["topology"], r["rate_mbit"], r["preset"]))
        if source is None:
            r["predicted_ms"], r["prediction_error"] = None, None
            continue
        r["predicted_ms"] = predict_ms(r, source["cpu_ms"], constants, cores, wire_ms(source))
        r["prediction_error"] = r["predicted_ms"] / r["comm_ms"] - 1


def write_results(rows: list[dict], args, out_dir: Path, meta: dict | None = None) -> None:
    """cluster.json, cluster.md and cluster.png of `rows` in `out_dir`; `meta` (date, machine,
    command) defaults to this run's."""
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = meta or {"date": datetime.date.today().isoformat(), "machine": platform.node(),
                    "cpus": os.cpu_count(), "command": " ".join(sys.argv)}
    (out_dir / "cluster.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = [
        "# Emulated cluster: measured communication and step time", "",
        f"Machine: {meta['cpus']} CPUs ({platform.processor() or platform.machine()}), "
        f"date {meta['date']}. Command: `{meta['command']}`"
        + (f" ({meta['rescored']})" if "rescored" in meta else ""), "",
        f"Bucket: {rows[0]['bucket_numel']:,} elements (fp32 gradients, bf16 parameters); "
        f"links shaped with tc (tbf rate; {args.delay_ms} ms added one-way delay); training: "
        f"`examples/gpt_cpu/train.py {args.model}`, median step after {args.warmup_steps} "
        "warm-up steps. Times are the slowest rank's, median of --reps runs "
        f"({args.reps}) with [min-max]; comm = reduce-scatter then all-gather, timed together. "
        "link ms = the bytes one bucket's two collectives send over the busiest node link "
        "(the core's plan: all-to-alls straight to each peer, all-gathers in a ring; "
        "uncompressed: rings, the least an uncompressed collective sends) at the link rate; "
        "link/measured "
        "= how close the measurement comes to the link's limit. Uncompressed: gloo's "
        "reduce-scatter and all-gather (baseline); best = the faster of that and a "
        "reduce-scatter made of an all-to-all and a local sum (each byte sent once). "
        "Model: sdp4bit.plan's cost model with the constants bench/calibrate_plan.py fits on "
        "bench/results/cluster_cpu.json: one rank's CPU per call, stretched by the ranks "
        "sharing the machine's cores, overlapped with the link time of the bytes the busiest "
        "node link carried (the row's own accounting, else cluster_cpu.json's; "
        "docs/performance.md \"The cost model\").",
        "",
        "| topology | link | preset | RS ms | AG ms | comm ms [min-max] | link ms | "
        "link/measured | bytes sent/rank | speedup vs gloo | speedup vs best uncompressed | "
        "ideal (byte ratio) | model ms | model error | step ms | step speedup |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['topology']} | {r['rate_mbit'] / 1000:g} Gbit/s | {r['preset']} | "
            f"{r['rs_ms']:.1f} | {r['ag_ms']:.1f} | {r['comm_ms']:.1f} "
            f"[{r['comm_min_ms']:.1f}-{r['comm_max_ms']:.1f}] | {r['link_ms']:.1f} | "
            f"{r['link_fraction']:.2f} | {r['bucket_bytes']:,} | {r['comm_speedup']:.2f}x | "
            f"{r['best_speedup']:.2f}x | {r['ideal_speedup']:.2f}x | "
            + ("- | -" if r["predicted_ms"] is None
               else f"{r['predicted_ms']:.1f} | {100 * r['prediction_error']:+.0f}%")
            + f" | {r['step_ms']:.0f} | {r['step_speedup']:.2f}x |")
        if r["preset"] == "baseline":
            lines.append(
                f"| {r['topology']} | {r['rate_mbit'] / 1000:g} Gbit/s | uncompressed, RS by "
                f"all-to-all + sum | {r['rs_a2a_ms']:.1f} | {r['ag_ms']:.1f} | "
                f"{r['comm_a2a_ms']:.1f} [{r['comm_a2a_min_ms']:.1f}-{r['comm_a2a_max_ms']:.1f}]"
                f" | {r['link_ms']:.1f} | {r['link_ms'] / r['comm_a2a_ms']:.2f} | "
                f"{r['bucket_bytes']:,} | {r['comm_ms'] / r['comm_a2a_ms']:.2f}x | "
                f"{r['best_uncompressed_ms'] / r['comm_a2a_ms']:.2f}x | 1.00x | - | - | - | - |")
    (out_dir / "cluster.md").write_text("\n".join(lines) + "\n")
    plot(rows, out_dir / "cluster.png")


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = sorted({(r["topology"], r["rate_mbit"]) for r in rows})
    presets = list(dict.fromkeys(r["preset"] for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / len(presets)
    for k, preset in enumerate(presets):
        by = {(r["topology"], r["rate_mbit"]): r for r in rows if r["preset"] == preset}
        xs = [i + k * width for i in range(len(settings))]
        axes[0].bar(xs, [by[s]["comm_speedup"] for s in settings], width, label=preset)
        axes[1].bar(xs, [by[s]["step_speedup"] for s in settings], width, label=preset)
    labels = [f"{t}\n{r / 1000:g} Gbit/s" for t, r in settings]
    for ax, title in zip(axes, ("communication speedup (RS + AG)", "training step speedup")):
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(settings))], labels)
        ax.set_title(title)
        ax.axhline(1.0, color="grey", lw=0.8)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def rescore(path: Path, parser: argparse.ArgumentParser, out_dir: Path) -> None:
    """Rewrites the results in `out_dir` from the measurements in `path` (a cluster.json) with
    the current cost model's columns, keeping the measurement's date, machine and command."""
    data = json.loads(path.read_text())
    meta = data["meta"]
    argv = meta["command"].split()
    script = next(i for i, a in enumerate(argv) if a.endswith("cluster.py"))
    args = parser.parse_args(argv[script + 1:])
    rows = data["rows"]
    derive(rows)
    add_predictions(rows, meta["cpus"])
    meta["rescored"] = (f"model columns recomputed {datetime.date.today().isoformat()} with "
                        "`bench/cluster.py --rescore`")
    write_results(rows, args, out_dir, meta)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--topologies", default="2x2,4x1", help="NODESxRANKS, comma-separated")
    p.add_argument("--rates-mbit", default="1000,10000", help="link rates, comma-separated")
    p.add_argument("--delay-ms", type=float, default=0.0,
                   help="one-way link delay (needs the kernel's netem)")
    p.add_argument("--numel", type=int, default=1 << 22, help="bucket elements")
    p.add_argument("--reps", type=int, default=5,
                   help="timed runs per measurement (after one warm-up)")
    p.add_argument("--presets", default="sdp4bit,qsdp,global-qsgd,zeropp",
                   help="compared with the uncompressed baseline")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup-steps", type=int, default=2)
    p.add_argument("--model", default="--width 256 --layers 4 --batch 2 --context 32 "
                   "--corpus-bytes 1000000", help="train.py model arguments")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--out", default=str(ROOT / "bench/results"))
    p.add_argument("--rescore", type=Path, default=None,
                   help="measure nothing: rewrite --out from this cluster.json's measurements "
                   "with the current cost model's columns")
    args = p.parse_args()
    if args.rescore is not None:
        rescore(args.rescore, p, Path(args.out))
        print((Path(args.out) / "cluster.md").read_text())
        return
    try:
        check_host()
    except ClusterUnavailable as error:
        raise SystemExit(f"bench/cluster.py: {error}")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for topology in args.topologies.split(","):
            for rate in (float(r) for r in args.rates_mbit.split(",")):
                print(f"== {topology} at {rate:g} Mbit/s", flush=True)
                rows += measure(topology, rate, args, Path(tmp))
    add_predictions(rows, os.cpu_count() or 1)
    write_results(rows, args, Path(args.out))
    print((Path(args.out) / "cluster.md").read_text())


if __name__ == "__main__":
    main()

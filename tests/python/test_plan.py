"""The cost model (python -m sdp4bit.plan) and the emulated-cluster harness's smoke run."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sdp4bit import kernel_times, plan

ROOT = Path(__file__).resolve().parents[2]


def test_bytes_come_from_the_core_and_scale_linearly():
    labels = [0, 0, 1, 1]
    small = torch.ops.sdp4bit.plan_wire_bytes("sdp4bit", labels, 4 * (1 << 16), 5)
    large = torch.ops.sdp4bit.plan_wire_bytes("sdp4bit", labels, 4 * (1 << 18), 5)
    assert [4 * x for x in small] == large
    mine, base = plan.step_bytes("sdp4bit", 4 * (1 << 18), dp=4, per_node=2)
    assert (mine.grad, mine.weight) == ((large[0], large[1]), (large[2], large[3]))
    assert (base.grad, base.weight) == ((large[4], large[5]), (large[6], large[7]))
    # 4-bit inter-node gradients after 8-bit intra-node reduction: under 1/7 of fp32's bytes.
    assert mine.grad[1] < base.grad[1] / 7


def test_node_link_bytes_add_up_all_to_alls_and_count_rings_once():
    mine, base = plan.step_bytes("sdp4bit", 4 * (1 << 18), dp=4, per_node=2)
    # The reduce-scatter's inter-node all-to-all: both ranks of a node send on its link.
    # The all-gather's ring: every shard but one crosses, what one rank sends in all.
    assert plan.node_link_bytes(mine, 2, True) == 2 * mine.grad[1] + sum(mine.weight)
    assert plan.node_link_bytes(base, 2, False) == sum(base.grad) + sum(base.weight)
    # One rank per node: a ring and direct sends put the same bytes on the link.
    mine, base = plan.step_bytes("qsdp", 4 * (1 << 18), dp=4, per_node=1)
    assert plan.node_link_bytes(mine, 1, True) == mine.grad[1] + mine.weight[1]
    assert plan.node_link_bytes(base, 1, False) == base.grad[1] + base.weight[1]
    # One node: nothing crosses.
    mine, base = plan.step_bytes("sdp4bit", 4 * (1 << 18), dp=4, per_node=4)
    assert plan.node_link_bytes(mine, 4, True) == plan.node_link_bytes(base, 4, False) == 0


def test_node_link_bytes_match_the_emulated_links_counts():
    """The plan's busiest-link bytes against what the emulated cluster's link interfaces
    counted (bench/results/cluster_cpu.json; headers included, so the count is a little
    higher): every compressed preset within 2% at every topology and rate."""
    rows = json.loads((ROOT / "bench/results/cluster_cpu.json").read_text())["rows"]
    checked = 0
    for r in rows:
        if r["preset"] == "baseline":
            continue  # gloo's reduce-scatter is no ring (docs/performance.md)
        nodes, per_node = (int(x) for x in r["topology"].split("x"))
        planned = plan.bucket_link_ms(r["preset"], r["bucket_numel"], nodes, per_node,
                                      r["rate_mbit"]) * r["rate_mbit"] / 8e-3
        assert planned <= r["wire_bytes"] <= 1.02 * planned, r
        checked += 1
    assert checked >= 16


def test_speedups_follow_the_links():
    slow = plan.Cluster(4, 8, tp=2, inter_gbps=25)
    fast = plan.Cluster(4, 8, tp=2, inter_gbps=3200, intra_gbps=3200)
    by = {c: {r["preset"]: r for r in plan.predict(1.3e9, c)} for c in (slow, fast)}
    assert by[slow]["baseline"]["comm_speedup"] == pytest.approx(1.0)
    assert by[slow]["sdp4bit"]["comm_speedup"] > 3.5
    assert by[slow]["sdp4bit"]["comm_speedup"] > by[fast]["sdp4bit"]["comm_speedup"]
    with_compute = plan.predict(1.3e9, slow, ("sdp4bit",), compute_ms=1000.0)[0]
    assert 1.0 < with_compute["step_speedup"] < with_compute["comm_speedup"]
    codec = plan.predict(1.3e9, fast, ("sdp4bit",), codec_gbps=1.0)[0]
    assert codec["comm_ms"] > by[fast]["sdp4bit"]["comm_ms"]


def test_hybrid_sharding_adds_the_all_reduce_across_groups():
    one = plan.Cluster(16, 8, inter_gbps=400)
    hybrid = plan.Cluster(16, 8, inter_gbps=400, instances=4)
    assert all(r["cross_bytes"] == 0 and r["cross_ms"] == 0 for r in plan.predict(1.3e9, one))
    # A ring all-reduce of fp32 sends 2 (n - 1) / n x 4 bytes per element of the shard;
    # Global-QSGD's int8 for 4 groups (K = 31) a quarter of that.
    shard = 1.3e9 / 32
    exact = 2 * 3 / 4 * shard * 4
    compressed, uncompressed = plan.cross_group_bytes(shard, 4)
    assert uncompressed == pytest.approx(exact) and compressed == pytest.approx(exact / 4)
    rows = {r["preset"]: r for r in plan.predict(1.3e9, hybrid)}
    assert rows["baseline"]["cross_bytes"] == pytest.approx(exact)
    assert rows["sdp4bit"]["cross_bytes"] == pytest.approx(exact / 4)
    inside, _ = plan.step_bytes("sdp4bit", 1.3e9, 32, 8)  # sharded over one group's 32 ranks
    assert rows["sdp4bit"]["bytes"] == pytest.approx(
        sum(inside.grad) + sum(inside.weight) + exact / 4)
    assert 0 < rows["sdp4bit"]["cross_ms"] < rows["baseline"]["cross_ms"]
    assert rows["sdp4bit"]["comm_speedup"] > 3


def test_bad_shapes_are_rejected():
    with pytest.raises(ValueError, match="do not split"):
        plan.Cluster(2, 8, tp=3).dp_layout()
    with pytest.raises(ValueError, match="groups of whole nodes"):
        plan.Cluster(4, 8, instances=8).group_layout()
    with pytest.raises(ValueError, match="instances must be at least 1"):
        plan.Cluster(4, 8, instances=0)
    with pytest.raises(ValueError, match="ranks_per_core must be positive"):
        plan.Cluster(2, 8, ranks_per_core=0)
    with pytest.raises(ValueError, match="core_share must be positive"):
        plan.Transport(core_share=0)
    with pytest.raises(ValueError, match=r"unhidden_codec must be in \[0, 1\]"):
        plan.Transport(unhidden_codec=1.5)


def test_command_line(tmp_path):
    out = subprocess.run([sys.executable, "-m", "sdp4bit.plan", "--paper"], cwd=tmp_path,
                         capture_output=True, text=True, check=True).stdout
    assert "2.39x-3.44x" in out and "1.53x-4.08x" in out and "sdp4bit" in out
    assert "4 sharded groups of 4 nodes" in out and "across groups: GB" in out
    bad = subprocess.run([sys.executable, "-m", "sdp4bit.plan", "--params", "1e9", "--nodes",
                          "4", "--gpus-per-node", "8", "--instances", "3"], cwd=tmp_path,
                         capture_output=True, text=True)
    assert bad.returncode != 0 and "groups of whole nodes" in bad.stderr
    bad = subprocess.run([sys.executable, "-m", "sdp4bit.plan", "--nodes", "2"],
                         cwd=tmp_path, capture_output=True, text=True)
    assert bad.returncode != 0 and "--params, --gpus-per-node required" in bad.stderr
    bad = subprocess.run([sys.executable, "-m", "sdp4bit.plan", "--paper", "--link-fraction",
                          "0"], cwd=tmp_path, capture_output=True, text=True)
    assert bad.returncode != 0 and "link_fraction must be positive" in bad.stderr


def test_the_step_is_communication_alone_without_codec_and_compute():
    """The control: with neither codec time nor compute, every preset's predicted step speedup
    is its communication speedup, and its communication that of the communication-only rows."""
    _, cluster, _, _ = plan.PAPER[1]
    alone = plan.predict(6.7e9, cluster, transport=plan.PAPER_TRANSPORT)
    zero = plan.predict(6.7e9, cluster, compute_ms=0.0, transport=plan.PAPER_TRANSPORT,
                        codec_ms={r["preset"]: 0.0 for r in alone})
    for a, z in zip(alone, zero):
        assert z["step_speedup"] == pytest.approx(z["comm_speedup"])
        assert z["comm_ms"] == a["comm_ms"] and z["step_ms"] == a["comm_ms"]


def test_end_to_end_adds_the_kernels_and_the_compute():
    times = kernel_times.load("h100-2026-11-27")
    for _, cluster, _, gpu in plan.PAPER:
        alone = {r["preset"]: r for r in plan.predict(18e9, cluster,
                                                      transport=plan.PAPER_TRANSPORT)}
        today, target = ({r["preset"]: r for r in plan.end_to_end(
            18e9, cluster, gpu, times, ("sdp4bit", "zeropp", "baseline"), 40e6, 2048, t)}
            for t in (False, True))
        compute = kernel_times.compute_ms(18e9, 2048, times, gpu)
        for preset, row in today.items():
            # The codec overlaps the link as the model says; nothing overlaps compute.
            comm = alone[preset]["comm_ms"]
            assert row["compute_ms"] == compute
            assert compute + comm <= row["step_ms"] <= compute + comm + row["codec_ms"]
        assert today["baseline"]["codec_ms"] == 0 and today["sdp4bit"]["codec_missing"] == ()
        assert today["zeropp"]["codec_missing"]
        assert target["sdp4bit"]["codec_ms"] < today["sdp4bit"]["codec_ms"]
        assert target["sdp4bit"]["step_speedup"] > today["sdp4bit"]["step_speedup"] > 1
        assert today["sdp4bit"]["step_speedup"] < alone["sdp4bit"]["comm_speedup"]


def test_paper_options(tmp_path):
    def run(*args):
        return subprocess.run([sys.executable, "-m", "sdp4bit.plan", *args], cwd=tmp_path,
                              capture_output=True, text=True)

    out = run("--paper", "--kernels", "h100-2026-11-27", "--tokens-per-gpu", "8192")
    assert out.returncode == 0 and "6 x params x 8192 tokens per GPU" in out.stdout
    assert out.stdout.count("today (h100-2026-11-27)") == 4
    assert out.stdout.count("   prediction, ") == 4 and "a PREDICTION" in out.stdout
    bad = run("--paper", "--kernels", "nope")
    assert bad.returncode != 0 and "no kernel times called 'nope'" in bad.stderr
    bad = run("--params", "1e9", "--nodes", "2", "--gpus-per-node", "8", "--tokens-per-gpu", "1")
    assert bad.returncode != 0 and "apply to --paper" in bad.stderr


def test_the_committed_paper_prediction_is_what_the_command_prints(tmp_path):
    """bench/results/plan_paper.txt is `python -m sdp4bit.plan --paper`'s output under a
    header naming the command."""
    committed = (ROOT / "bench/results/plan_paper.txt").read_text().splitlines()
    assert committed[0].startswith("# python -m sdp4bit.plan --paper   (")
    out = subprocess.run([sys.executable, "-m", "sdp4bit.plan", "--paper"], cwd=tmp_path,
                         capture_output=True, text=True, check=True).stdout
    assert out.splitlines() == committed[1:]


def test_the_docs_end_to_end_figures_are_the_commands():
    """docs/performance.md's end-to-end figures are what `--paper` prints: the committed
    output, and the same at 8192 tokens per GPU."""
    doc = " ".join((ROOT / "docs/performance.md").read_text().split())
    summary = re.compile(r"sdp4bit: ([\d.]+)x today, ([\d.]+)x at the targets \(([\d.]+)x "
                         r"without codec time\).*?communication (\d+) ms, compute (\d+) ms, "
                         r"codec (\d+) ms\) and at the targets \(codec (\d+) ms\)")
    paper = summary.findall((ROOT / "bench/results/plan_paper.txt").read_text())
    # Per cluster the 6.7B and 18B lines, whose speedups the docs say are the same.
    (a100, a100_18b), (h800, h800_18b) = paper[:2], paper[2:]
    assert a100[:3] == a100_18b[:3] and h800[:3] == h800_18b[:3]
    assert (f"predicted {a100[0]}x faster than the baseline's on the A100 cluster ({a100[1]}x "
            f"at the targets, {a100[2]}x with no codec time)") in doc
    assert f"and {h800[0]}x on the H800 cluster ({h800[1]}x, {h800[2]}x)" in doc
    assert (f"{h800[3]} ms of communication, {h800[4]} ms of compute, {h800[5]} ms of codec "
            f"today and {h800[6]} ms at the targets") in doc
    out = subprocess.run([sys.executable, "-m", "sdp4bit.plan", "--paper", "--tokens-per-gpu",
                          "8192"], cwd="/tmp", capture_output=True, text=True, check=True).stdout
    wide = re.findall(r"sdp4bit: ([\d.]+)x today.*?(\w+) dominates", out)
    assert {dominant for _, dominant in wide} == {"compute"}
    assert f"step is predicted {wide[0][0]}x and {wide[2][0]}x faster" in doc


def _calibrate_plan():
    sys.path.insert(0, str(ROOT / "bench"))
    import calibrate_plan

    return calibrate_plan


def test_cpu_sharing_term_vanishes_at_one_rank_per_core():
    for ranks_per_core in (0.25, 0.5, 1.0):
        assert plan.cpu_ms(12.0, ranks_per_core, 0.3) == 12.0
    # 4 ranks on 2 cores: a rank's own work plus the other's it queues behind, at the share of
    # the cores' time the ranks get.
    assert plan.cpu_ms(12.0, 2.0, 1.0) == pytest.approx(24.0)
    assert plan.cpu_ms(12.0, 2.0, 0.5) == pytest.approx(36.0)
    assert plan.cpu_ms(12.0, 3.0, 1.0) == pytest.approx(36.0)
    cluster = plan.Cluster(2, 4, inter_gbps=1000)
    shared = plan.Cluster(2, 4, inter_gbps=1000, ranks_per_core=2.0)
    fast = plan.predict(1e9, cluster, ("sdp4bit",), codec_gbps=2.0)[0]["comm_ms"]
    slow = plan.predict(1e9, shared, ("sdp4bit",), codec_gbps=2.0)[0]["comm_ms"]
    assert slow > fast


def test_each_constant_moves_the_model_the_documented_way():
    base = plan.Transport(link_fraction=0.8, uncompressed_link_fraction=0.6,
                          unhidden_codec=0.2, uncompressed_unhidden=0.5, core_share=0.7,
                          wire_cpu=0.0)

    def t(work, link, compressed=True, ranks_per_core=2.0, **change):
        transport = plan.Transport(**{**base.__dict__, **change})
        return plan.collective_ms(work, link, compressed, transport, ranks_per_core)

    cpu_bound, link_bound = (20.0, 5.0), (5.0, 100.0)
    # eta: a faster transport shortens link-bound collectives, not CPU-bound ones beyond the
    # overlap term; eta_gloo acts on the uncompressed collectives only.
    assert t(*link_bound, link_fraction=1.0) < t(*link_bound)
    assert t(*link_bound, compressed=False, link_fraction=1.0) == t(*link_bound, compressed=False)
    assert t(*link_bound, compressed=False, uncompressed_link_fraction=0.9) < t(
        *link_bound, compressed=False)
    # beta: the unhidden share of the shorter part adds exactly beta x shorter.
    shorter = plan.cpu_ms(5.0, 2.0, 0.7)
    assert t(*link_bound, unhidden_codec=0.6) - t(*link_bound) == pytest.approx(0.4 * shorter)
    assert t(*link_bound, unhidden_codec=0.0) == pytest.approx(100.0 / 0.8)
    # kappa: a larger share of the cores shortens CPU-bound collectives where ranks share cores,
    # and does nothing at one rank per core.
    assert t(*cpu_bound, core_share=1.0) < t(*cpu_bound)
    assert t(*cpu_bound, ranks_per_core=1.0, core_share=1.0) == t(*cpu_bound, ranks_per_core=1.0)
    # beta_gloo: gloo's collectives, one part after the other at 1.
    assert t(*link_bound, compressed=False, uncompressed_unhidden=1.0) == pytest.approx(
        100.0 / 0.6 + shorter)
    # gamma: the transport's CPU per ms on the wire adds gamma x link time to a rank's work,
    # which a CPU-bound collective pays in full (stretched by the ranks sharing cores).
    assert t(*cpu_bound, wire_cpu=0.1) == pytest.approx(t(20.0 + 0.1 * 5.0, 5.0))
    assert t(*cpu_bound, wire_cpu=0.1) > t(*cpu_bound)
    with pytest.raises(ValueError, match="wire_cpu"):
        plan.Transport(wire_cpu=-0.1)


CORES = 2


def _fixture_rows(constants):
    """cluster_cpu.json rows made by the model itself: two topologies, a link-bound and a
    CPU-bound rate, presets whose CPU and link times differ, a CPU per call that grows by
    gamma per ms of link time, the baseline's link bytes counted on the link (the others'
    planned), the runs' spread 10%."""
    cal = _calibrate_plan()
    rows = []
    for topology, scale in (("2x2", 1.0), ("4x1", 0.75)):
        for preset, cpu, link in (("baseline", 25.0, 200.0), ("sdp4bit", 18.0, 26.0),
                                  ("qsdp", 16.0, 68.0), ("global-qsgd", 20.0, 100.0),
                                  ("zeropp", 12.0, 42.0)):
            for rate in (1000.0, 10000.0):
                row = {"topology": topology, "rate_mbit": rate, "preset": preset,
                       "link_ms": scale * link * 1000.0 / rate}
                if preset == "baseline":  # counted on the link: its algorithm's own bytes
                    row["wire_bytes"] = 0.8 * row["link_ms"] * rate / 8e-3
                row["cpu_ms"] = (cpu * (1.1 if topology == "4x1" else 1.0)
                                 + constants["gamma"] * cal.wire_ms(row))
                ms = cal.predict_ms(row, row["cpu_ms"], constants, CORES)
                row.update(comm_ms=ms, comm_min_ms=0.9 * ms, comm_max_ms=1.1 * ms,
                           sweep_min_ms=0.95 * ms, sweep_max_ms=1.05 * ms)
                rows.append(row)
    return rows


FIXTURE = {"kappa": 0.8, "eta": 0.9, "beta": 0.2, "eta_gloo": 0.6, "beta_gloo": 0.4,
           "gamma": 0.03}


def test_calibration_recovers_the_constants_of_a_fixture(tmp_path):
    cal = _calibrate_plan()
    rows = _fixture_rows(FIXTURE)
    source = tmp_path / "cluster_cpu.json"
    source.write_text(json.dumps({"meta": {"cpus": CORES, "date": "d", "command": "c"},
                                  "rows": rows}))
    loaded, meta = cal.load_rows(source)
    doc = cal.write(loaded, meta, source, tmp_path)
    assert doc["constants"] == pytest.approx(FIXTURE, abs=0.011)
    held_out = doc["held_out"]
    # Every row from the other rate, and every row from the other topology.
    assert len([e for e in held_out if e["scheme"] == "rate"]) == len(rows)
    assert len([e for e in held_out if e["scheme"] == "topology"]) == len(rows)
    assert max(abs(e["error"]) for e in held_out) < 0.02
    assert all(e["within_range"] for e in held_out)
    base = next(e for e in held_out if e["preset"] == "baseline" and e["rate_mbit"] == 1000.0)
    assert base["wire_ms"] == pytest.approx(0.8 * base["link_ms"])
    table = (tmp_path / "plan_calibration.md").read_text()
    assert table.count("| 4x1 | qsdp |") == 4
    assert f"largest error {100 * doc['largest_error']:.0f}%" in table
    assert json.loads((tmp_path / "plan_calibration.json").read_text()) == doc
    # A row the model does not fit is reported as such, not hidden.
    rows[0]["comm_ms"] *= 2
    bad = cal.held_out(rows, CORES)
    assert max(abs(e["error"]) for e in bad) > 0.3


def test_the_committed_calibration_is_what_the_script_computes(tmp_path):
    """plan_calibration.md/.json are the script's output on the committed measurements (no
    number typed by hand), and sdp4bit.plan's defaults are its constants."""
    cal = _calibrate_plan()
    source = ROOT / "bench/results/cluster_cpu.json"
    rows, meta = cal.load_rows(source)
    doc = cal.write(rows, meta, source, tmp_path)
    committed = ROOT / "bench/results"
    assert (tmp_path / "plan_calibration.md").read_text() == (
        committed / "plan_calibration.md").read_text()
    assert json.loads((committed / "plan_calibration.json").read_text()) == doc
    assert cal.default_constants() == doc["constants"]
    assert doc["largest_error"] == max(abs(e["error"]) for e in doc["held_out"])


def _netns_unavailable() -> str | None:
    sys.path.insert(0, str(ROOT / "bench"))
    from netns import ClusterUnavailable, check_host

    try:
        check_host()
    except ClusterUnavailable as error:
        return str(error)
    probe = subprocess.run(["ip", "netns", "add", f"s4bprobe{os.getpid()}"], capture_output=True,
                           text=True)
    if probe.returncode != 0:
        return f"network namespaces unavailable: {probe.stderr.strip()}"
    subprocess.run(["ip", "netns", "delete", f"s4bprobe{os.getpid()}"], capture_output=True)
    return None


@contextlib.contextmanager
def _emulated_cluster_bench(tmp_path, name: str, *args: str):
    """Runs `bash scripts/bench.sh NAME ARGS` on an emulated cluster (skipping where network
    namespaces are unavailable), yields its finished process, and checks afterwards that it
    left no namespace behind."""
    reason = _netns_unavailable()
    if reason:
        pytest.skip(reason)
    result = subprocess.run(["bash", str(ROOT / "scripts/bench.sh"), name, *args], cwd=tmp_path,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    yield result
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "s4b" not in listed.replace("s4bprobe", ""), "namespaces left behind"


def test_emulated_cluster_smoke(tmp_path):
    with _emulated_cluster_bench(
            tmp_path, "cluster", "--topologies", "2x1", "--rates-mbit", "1000", "--numel",
            "65536", "--reps", "1", "--steps", "2", "--warmup-steps", "1", "--presets", "sdp4bit",
            "--model", "--width 32 --layers 1 --batch 1 --context 8 --corpus-bytes 100000",
            "--out", str(tmp_path)):
        rows = json.loads((tmp_path / "cluster.json").read_text())["rows"]
        assert [r["preset"] for r in rows] == ["baseline", "sdp4bit"]
        assert rows[1]["bucket_bytes"] < rows[0]["bucket_bytes"] / 3
        assert all(r["cpu_ms"] > 0 and r["predicted_ms"] > 0 for r in rows), rows
        assert (tmp_path / "cluster.png").stat().st_size > 0


def test_emulated_cluster_hybrid_smoke(tmp_path):
    # 2 one-rank nodes as 2 distributed-optimizer instances: every gradient byte between the
    # nodes is the all-reduce across the instances, fp32 for Megatron's own, 8-bit integers
    # for sdp4bit's (plus the absmax word and the headers); the weights stay in their node.
    with _emulated_cluster_bench(
            tmp_path, "cluster_hybrid", "--nodes", "2", "--instances", "2", "--steps", "3",
            "--short-steps", "1", "--warmup-steps", "1", "--reps", "1", "--model",
            "--width 32 --layers 1 --batch 1 --context 8 --corpus-bytes 100000",
            "--out", str(tmp_path)):
        rows = {r["preset"]: r for r in
                json.loads((tmp_path / "cluster_hybrid.json").read_text())["rows"]}
        assert set(rows) == {"megatron", "sdp4bit"}
        ratio = rows["sdp4bit"]["busiest_link_bytes"] / rows["megatron"]["busiest_link_bytes"]
        assert 0 < ratio < 0.5, rows
        assert "busiest link bytes" in (tmp_path / "cluster_hybrid.md").read_text()


def test_emulated_cluster_phases_smoke(tmp_path):
    out = tmp_path / "phases.json"
    with _emulated_cluster_bench(
            tmp_path, "cluster_phases", "--topologies", "2x1", "--rates-mbit", "1000", "--numel",
            "1048576", "--reps", "1", "--variants", ";pipeline_chunks=1,threads=1", "--out",
            str(out)) as result:
        results = json.loads(out.read_text())
        rows = results["phases"]
        rs = [r for r in rows if r["collective"] == "reduce_scatter"]
        assert sorted((r["variant"], r["rank"]) for r in rs) == [
            ("defaults", 0), ("defaults", 1), ("pipeline_chunks=1,threads=1", 0),
            ("pipeline_chunks=1,threads=1", 1)]
        # 2 x 1: one inter-node level; the automatic P splits a 2^19-element shard in two.
        assert {r["variant"]: r["chunks"] for r in rs} == {
            "defaults": 2, "pipeline_chunks=1,threads=1": 1}
        for r in rows:
            phases = sum(r[k] for k in r if k.endswith("_ms") and k != "total_ms")
            assert r["calls"] >= 3 and r["first_pass_ms"] > 0, r
            assert phases <= r["total_ms"] * 1.5, r  # medians of parts vs the median total
        assert "| 2x1 | 1 Gbit/s | defaults | reduce_scatter | 0 | 2 |" in result.stdout
        cpu = results["cpu"]
        assert sorted((r["variant"], r["rank"]) for r in cpu) == sorted(
            (r["variant"], r["rank"]) for r in rs)
        for r in cpu:
            threads = r["groups"]
            # The calling thread starts and waits; the passes and exchanges run on other
            # threads.
            assert threads["main"]["cpu_ms"] > 0, r
            assert threads["executor_gloo_other"]["cpu_ms"] > 0, r
            busy = sum(g["cpu_ms"] for g in threads.values())
            assert busy < os.cpu_count() * r["wall_ms"] + 50, r
            assert r["latency"]["a2a_world_ms"] > 0 and "a2a_intra_ms" not in r["latency"], r
            assert 0 < r["latency"]["sdp4bit_rs_tiny_ms"] < r["wall_ms"], r
        assert "| 2x1 | 1 Gbit/s | defaults | 0 |" in result.stdout


def test_emulated_cluster_cpu_smoke(tmp_path):
    out = tmp_path / "cluster_cpu.json"
    with _emulated_cluster_bench(
            tmp_path, "cluster_cpu", "--topologies", "2x1", "--rates-mbit", "1000", "--numel",
            "65536", "--reps", "1", "--sweeps", "2", "--presets", "sdp4bit", "--out", str(out)):
        data = json.loads(out.read_text())
        assert data["meta"]["cpus"] == os.cpu_count()
        rows = data["rows"]
        assert [r["preset"] for r in rows] == ["baseline", "sdp4bit"]
        for r in rows:
            assert len(r["runs"]) == 2 and all(len(x["rank_cpu_ms"]) == 2 for x in r["runs"])
            assert r["cpu_ms"] > 0 and r["link_ms"] > 0, r
            assert r["sweep_min_ms"] <= r["comm_ms"] <= r["sweep_max_ms"], r
            assert r["comm_min_ms"] <= r["sweep_min_ms"] and r["sweep_max_ms"] <= r["comm_max_ms"]
        assert rows[1]["link_ms"] < rows[0]["link_ms"] / 3


def test_the_committed_cluster_table_has_the_current_model_columns(tmp_path):
    """bench/results/cluster.md's model columns are what the current model predicts from the
    committed measurements (`bench/cluster.py --rescore` rewrites them when the model
    changes), and rescoring keeps every measured number."""
    committed = ROOT / "bench/results"
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench/cluster.py"), "--rescore",
         str(committed / "cluster.json"), "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

    def table(path):
        return [line for line in path.read_text().splitlines() if line.startswith("| ")]

    assert table(tmp_path / "cluster.md") == table(committed / "cluster.md")
    before = json.loads((committed / "cluster.json").read_text())["rows"]
    after = json.loads((tmp_path / "cluster.json").read_text())["rows"]
    model = {"predicted_ms", "prediction_error"}
    assert [{k: v for k, v in r.items() if k not in model} for r in after] == [
        {k: v for k, v in r.items() if k not in model} for r in before]
    assert any(r["prediction_error"] is not None for r in after)

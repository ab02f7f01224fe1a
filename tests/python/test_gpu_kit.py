"""The GPU kit (scripts/gpu_kit.sh, scripts/gpu_kit.py): the prepared folder holds every part
within its size limit, its dry run on a host without a GPU skips every GPU stage saying why
and exits with the documented status, and the report's pieces (the benchmark table joined with
the kernel model, the cost of compression against a GEMM step and issue 42's targets, the
sweep, ncu's figures) are computed right; the sweep and ncu stages run end to end against a
stand-in benchmark and a stand-in ncu."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
KIT = ROOT / ".cache" / "gpu-kit"


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


gpu_kit = _load("gpu_kit", ROOT / "scripts" / "gpu_kit.py")
gpu_cost = _load("gpu_cost", ROOT / "bench" / "gpu_cost.py")


@pytest.fixture(scope="module")
def kit() -> Path:
    """The kit the test command prepared (required there: SDP4BIT_REQUIRE_GPU_KIT=1)."""
    if not (KIT / gpu_kit.MANIFEST).is_file():
        if os.environ.get("SDP4BIT_REQUIRE_GPU_KIT") == "1":
            pytest.fail(f"no prepared kit at {KIT}")
        pytest.skip("no prepared kit (bash scripts/gpu_kit.sh prepare)")
    return KIT


def test_the_kit_holds_every_part_within_its_size(kit):
    manifest = json.loads((kit / gpu_kit.MANIFEST).read_text())
    assert gpu_kit.missing_parts(kit) == []
    assert manifest["files"] == gpu_kit.kit_files(kit)
    assert manifest["total_bytes"] == sum(manifest["files"].values()) < 56 * 2**20
    assert manifest["sources_sha256"] == gpu_kit.source_hash(), "the kit is stale"
    for binary in gpu_kit.BINARIES:
        assert os.access(kit / binary, os.X_OK), binary


def test_a_kit_lacking_a_part_is_refused(tmp_path):
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "cuda_gpu").write_bytes(b"\x7fELF")
    assert gpu_kit.write_manifest(tmp_path, 56) == 1
    assert "bin/bench_gpu" in gpu_kit.missing_parts(tmp_path)
    assert not (tmp_path / gpu_kit.MANIFEST).exists()


def test_dry_run_without_a_gpu_skips_every_gpu_stage(kit, tmp_path):
    out = tmp_path / "out"
    command = ["bash", "scripts/gpu_kit.sh", "run", "--out", str(out), "--kit", str(kit)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == gpu_kit.EXIT_NO_GPU, done.stdout + done.stderr
    report = (out / "report.md").read_text()
    rows = dict(re.findall(r"^\| ([\w-]+) \| (PASS|FAIL|SKIP) \|", report, re.M))
    gpu_stages = {s.name for s in gpu_kit.STAGES if s.needs_gpu}
    assert set(rows) == {s.name for s in gpu_kit.STAGES}, rows
    assert {rows[name] for name in gpu_stages} == {"SKIP"}, rows
    # The CPU stages ran: the prebuilt extension loaded and the bundle built another.
    assert rows["host"] == rows["prebuilt"] == rows["build"] == "PASS", report
    assert "sees no CUDA GPU" in report
    # The sweep and ncu stages are there, skipped with the reason.
    for name in ("sweep", "ncu"):
        row = re.search(rf"^\| {name} \| SKIP \| \d+ \| (.*) \|$", report, re.M)
        assert row and "sees no CUDA GPU" in row.group(1), report
    with tarfile.open(out / "logs.tar.gz") as tar:
        names = tar.getnames()
    assert "logs/build.log" in names and "logs/prebuilt.log" in names, names
    assert sorted(p.name for p in out.iterdir()) == ["logs.tar.gz", "report.md"]


def test_report_joins_the_benchmark_with_the_kernel_model():
    estimates = gpu_kit.model_estimates()
    assert len(estimates) == 13 and set(estimates) >= {"(1)", "(1b)", "(8c)"}, estimates
    nbytes, issue_us, serial_us = estimates["(1)"]
    assert nbytes > 3e8 and 0 < issue_us and 0 < serial_us, estimates["(1)"]
    table = "\n".join([
        "| row | kernel | read MiB | written MiB | median us | min us | GB/s | x copy | target |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|",
        "| baseline: copy | - | 1 | 1 | 1 | 1 | 3000.0 | 1.00 | - |",
        "| (1) grad first: H32 | grad_quantize_first | 1 | 1 | 800.0 | 1 | 670.0 | 0.22 | met |",
        "| (8c) Global-QSGD dequantize | global_dequantize_i8 | 1 | 1 | 50.0 | 1 | 1 | 1 | met |",
        "| (9) unknown | x | 1 | 1 | 1 | 1 | 1 | 1 | met |"])
    joined = gpu_kit.with_model_estimates(table).splitlines()
    assert joined[0].endswith("| model us (kernels.md, this copy) | measured / model |")
    assert joined[1].endswith("|---:|---:|")
    assert joined[2].endswith("| - | - |")
    model_us = max(nbytes / 3e6, issue_us, serial_us)
    assert joined[3].endswith(f"| {model_us:.1f} | {800.0 / model_us:.2f} |"), joined[3]
    # A memory-bound row: its bytes over this run's copy.
    nbytes, issue_us, serial_us = estimates["(8c)"]
    assert nbytes / 3e6 > max(issue_us, serial_us)
    assert joined[4].endswith(f"| {nbytes / 3e6:.1f} | {50.0 / (nbytes / 3e6):.2f} |"), joined[4]
    assert joined[5].endswith("| - | - |")


def test_cost_against_a_gemm_step():
    output = ("noise\ncost-json: " + json.dumps({
        "device": "X", "preset": "sdp4bit", "world": "2x2", "copy_gbps": 4000.0,
        "rows": [{"numel": 64 << 20, "grad": "fp32", "reduce_scatter_ms": 1.5,
                  "all_gather_ms": 0.5, "bytes": 4_000_000_000},
                 {"numel": 64 << 20, "grad": "bf16", "reduce_scatter_ms": 0.4,
                  "all_gather_ms": 0.4, "bytes": 4_000_000_000}]}) + "\n"
              + "concurrent-json: " + json.dumps({
                  "device": "X", "numel": 64 << 20, "hidden": 2368, "tokens": 8192,
                  "rows": [{"grad": "fp32", "gemm_ms": 4.0, "gemm_beside_ms": 4.2,
                            "compression_ms": 1.0, "compression_beside_ms": 1.5,
                            "both_ms": 4.2}]}) + "\n")
    costs = gpu_cost.parse_costs(output)
    hidden = gpu_cost.layer_hidden(64 << 20)
    assert hidden % 64 == 0 and abs(12 * hidden**2 / (64 << 20) - 1) < 0.02
    rows, fractions = gpu_cost.table(costs, 8192, {hidden: 10.0})
    assert fractions == [0.2, 0.08]
    assert rows[-2].endswith("| 1.500 + 0.500 | 20.0% | **missed** |"), rows[-2]
    assert rows[-1].endswith("| 0.400 + 0.400 | 8.0% | met |"), rows[-1]
    lines = gpu_cost.target_lines(costs, fractions, 8192, gpu_cost.parse_concurrent(output))
    # 4e9 bytes at 4000 GB/s take 1 ms: 2.0x and 0.8x of it against the 1.5x target.
    assert lines[1].endswith("1.000 ms for 3814.7 MiB at 4000.0 GB/s, 2.00x: **missed**"), lines
    assert lines[2].endswith("0.80x: met"), lines
    assert lines[3].endswith("(64 Mi, fp32 gradients): 20.0%: **missed**"), lines
    assert lines[4].endswith("(64 Mi, bf16 gradients): 8.0%: met"), lines
    assert "4.000 ms alone, 4.200 ms beside, slowdown +5.0% (reported" in lines[5], lines
    assert gpu_cost.sequence_target() == 1.5
    # An older benchmark's output: no bytes, no copy, no GEMM beside the kernels.
    old = {"device": "X", "preset": "sdp4bit", "world": "2x2",
           "rows": [{"numel": 64 << 20, "grad": "fp32", "reduce_scatter_ms": 1.5,
                     "all_gather_ms": 0.5}]}
    lines = gpu_cost.target_lines(old, [0.2], 8192, gpu_cost.parse_concurrent("nothing"))
    assert "not known" in lines[1] and lines[-1].endswith("(its section did not run)"), lines
    with pytest.raises(ValueError, match="no cost-json line"):
        gpu_cost.parse_costs("nothing")


def test_the_benchmark_checks_the_targets_the_cost_model_uses():
    # bench/gpu.rs writes issue 42's targets for its met / missed columns; they are
    # sdp4bit/kernel_times.py's, the one place the cost model reads them from.
    kernel_times = _load("kernel_times_for_the_kit", ROOT / "sdp4bit" / "kernel_times.py")
    source = (ROOT / "bench" / "gpu.rs").read_text()
    block = re.search(r"^const TARGETS: \[\(&str, f64\); \d+\] = \[(.*?)^\];", source,
                      re.M | re.S).group(1)
    bench = {name: float(v) for name, v in re.findall(r'\("(\w+)", ([\d.]+)\)', block)}
    assert bench == kernel_times.TARGETS.copy_fraction
    sequence = re.search(r"^const SEQUENCE_TARGET: f64 = ([\d.]+);", source, re.M).group(1)
    assert float(sequence) == kernel_times.TARGETS.sequence == gpu_cost.sequence_target()
    # The kernels the rows launch are the ones with targets.
    rows = source[source.index("// Rows."):source.index("// Section `kernels`.")]
    kernels = {re.sub(r"(?<!^)([A-Z])", r"_\1", k).lower()
               for k in re.findall(r"Kernel::(\w+)", rows)}
    assert kernels == set(bench), kernels ^ set(bench)


def test_stages_fit_the_lease_in_order_of_value():
    names = [s.name for s in gpu_kit.STAGES]
    # The correctness of the kernels first, then the sweep (the point of a GPU session: every
    # variant byte-compared and timed), the bench and its cost, ncu, then the rest.
    assert names[:8] == ["host", "prebuilt", "selftest", "rust-kernels", "sweep", "bench",
                         "cost", "ncu"], names
    limits = {s.name: s.limit for s in gpu_kit.STAGES}
    assert limits["sweep"] <= 300  # issue 42: the sweep at most 5 minutes
    # The default deadline leaves a 15-minute lease room for the machine's start and a rerun.
    parser_default = re.search(r'"--deadline", type=float, default=([\d.]+)',
                               (ROOT / "scripts" / "gpu_kit.py").read_text()).group(1)
    assert float(parser_default) <= 420


def test_report_name_and_cublas_search(tmp_path, monkeypatch):
    ctx = gpu_kit.Context(kit=tmp_path, out=tmp_path, logs=tmp_path, deadline=0.0,
                          gpu="NVIDIA H200 (sm_90, 132 SMs, 140 GiB)")
    assert re.fullmatch(r"bench/results/gpu/\d{4}-\d\d-\d\d-h200-kit\.md",
                        gpu_kit.report_name(ctx)), gpu_kit.report_name(ctx)
    lib = tmp_path / "site" / "nvidia" / "cu13" / "lib"
    lib.mkdir(parents=True)
    (lib / "libcublas.so.13").write_bytes(b"")
    monkeypatch.setattr(sys, "path", [str(tmp_path / "site"), *sys.path])
    assert gpu_kit.cublas_dirs()[0] == str(lib)
    env = gpu_kit.bench_env(ctx, "sweep", SDP4BIT_BENCH_REPORT="r.md")
    assert env["LD_LIBRARY_PATH"].split(os.pathsep)[0] == str(lib)
    assert env["SDP4BIT_BENCH_SECTIONS"] == "sweep" and env["SDP4BIT_BENCH_REPORT"] == "r.md"


def test_the_runner_and_the_cost_script_need_no_third_party_package_at_import():
    # The host's python3 runs the runner before anything is installed; torch is imported
    # inside the stages (and the cost script's GPU path) only.
    for script in ("scripts/gpu_kit.py", "bench/gpu_cost.py"):
        text = (ROOT / script).read_text()
        top = [line for line in text.splitlines() if re.match(r"^(import|from) ", line)]
        assert not [line for line in top if re.search(r"\b(torch|numpy|sdp4bit)\b", line)], top
    done = subprocess.run([sys.executable, "-I", "-S", str(ROOT / "scripts" / "gpu_kit.py"),
                           "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_the_cost_script_says_why_it_skips_without_a_gpu(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "bench/gpu_cost.py"), "--out",
                           str(tmp_path / "cost.md")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "skipped: torch sees no CUDA GPU", done.stdout
    assert not (tmp_path / "cost.md").exists()


#: A stand-in for the kit's benchmark binary: the lines the sweep and ncu stages read, for the
#: section it is asked for.
FAKE_BENCH = """#!/usr/bin/env python3
import json, os
sections = os.environ["SDP4BIT_BENCH_SECTIONS"]
print("# sdp4bit GPU benchmark")
print("")
print("- device: Fake GPU (ordinal 0), compute capability 9.0, 1 SMs, 1 MiB L2, 1.0 GiB memory")
if sections == "sweep":
    print("- device-to-device copy: 4000.0 GB/s (read + written; 256 MiB, median 134.2 us of 51 calls)")
    print("")
    print("## Sweep of the kernel variants (256 MiB buckets)")
    print("")
    print("### (8c) Global-QSGD dequantize")
    print("")
    print("| variant | units | threads | min blocks | grid/SM | median us | min us | spread | GB/s | x copy | vs production |")
    print("| `u1t256m6 g32` (production) | 1 | 256 | 6 | 32 | 30.0 | 29.0 | 0.5% | 2796.2 | 0.70 | 1.00 |")
    print("| `u1t256m6 g4` (fastest) (chosen) | 1 | 256 | 6 | 4 | 25.0 | 24.0 | 0.5% | 3355.4 | 0.84 | 1.20 |")
    print("report: " + os.environ.get("SDP4BIT_BENCH_REPORT", ""))
    print("")
    print("sweep: 2 variants of 1 rows byte-equal to the production kernels in 3 s; 0 of 1 rows meet their targets at the fastest variant (production: 0); 1 rows have a variant faster beyond the noise.")
    v = lambda grid, us: {"entry": "global_dequantize_i8__n__u1t256m6", "grid_blocks": grid, "median_us": us, "min_us": us, "spread": 0.005}
    print("")
    print("sweep-json: " + json.dumps({"device": "Fake GPU", "arch": "sm_90", "copy_gbps": 4000.0, "bucket_bytes": 268435456, "report": "x", "rows": [{"row": "(8c)", "label": "(8c) Global-QSGD dequantize", "kernel": "global_dequantize_i8", "read": 16777216, "written": 67108864, "elements": 16777216, "target": 0.85, "production": v(32, 30.0), "fastest": v(4, 25.0), "chosen": v(4, 25.0), "variants": [v(32, 30.0), v(4, 25.0)]}]}))
elif sections == "profile":
    rows = []
    for item in filter(None, os.environ.get("SDP4BIT_BENCH_VARIANTS", "").split(",")):
        entry, grid = item.split(":")
        rows.append({"row": "(8c)", "label": "(8c)", "entry": entry, "grid_blocks": int(grid), "elements": 16777216, "bytes": 83886080})
    print("profile-json: " + json.dumps({"device": "Fake GPU", "rows": rows}))
"""

#: A stand-in for ncu: records its arguments, runs the program it profiles (or refuses, as ncu
#: does where it cannot read the counters), and prints a raw page as CSV on --import, in
#: ncu's automatic units.
FAKE_NCU = """#!/usr/bin/env python3
import json, os, subprocess, sys
args = sys.argv[1:]
if "--import" in args:
    print('"ID","Kernel Name","gpu__time_duration.sum","smsp__inst_executed.sum","smsp__issue_active.avg.pct_of_peak_sustained_active","dram__throughput.avg.pct_of_peak_sustained_elapsed","dram__bytes_read.sum","dram__bytes_write.sum","launch__registers_per_thread","sm__warps_active.avg.pct_of_peak_sustained_active","smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio","smsp__average_warps_issue_stalled_selected_per_issue_active.ratio","smsp__average_warps_issue_stalled_wait_per_issue_active.ratio","smsp__average_warps_issue_stalled_lg_throttle_per_issue_active.ratio","smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio"')
    units = "base" in args
    print('"","",' + ('"nsecond","inst","%","%","byte","byte"' if units else '"usecond","inst","%","%","Mbyte","Mbyte"') + ',"register/thread","%","","","","",""')
    print('"0","global_dequantize_i8__n__u1t256m6",' + ('"25,000","4,194,304"' if units else '"25.00","4,194,304"') + ',"31.5","88.2",' + ('"16,777,216","67,108,864"' if units else '"16.78","67.11"') + ',"30","75.5","12.5","1.00","2.25","0.75","0.10"')
    sys.exit(0)
with open(os.environ["FAKE_NCU_ARGS"], "w") as f:
    json.dump({"args": args, "variants": os.environ.get("SDP4BIT_BENCH_VARIANTS")}, f)
if os.environ.get("FAKE_NCU_REFUSE"):
    print("==ERROR== ERR_NVGPUCTRPERM - The user does not have permission to access NVIDIA GPU Performance Counters on the target device 0.")
    sys.exit(1)
export = args[args.index("--export") + 1]
open(export, "w").write("report")
print("==PROF== Connected to process")
sys.exit(subprocess.run([args[-1]]).returncode)
"""


def _script(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)
    return path


def test_sweep_and_ncu_stages_against_stand_ins(tmp_path, monkeypatch):
    kit, out, logs = tmp_path / "kit", tmp_path / "out", tmp_path / "logs"
    _script(kit / "bin" / "bench_gpu", FAKE_BENCH)
    _script(tmp_path / "tools" / "ncu", FAKE_NCU)
    out.mkdir()
    logs.mkdir()
    monkeypatch.setenv("PATH", f"{tmp_path / 'tools'}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_NCU_ARGS", str(tmp_path / "ncu-args.json"))
    ctx = gpu_kit.Context(kit=kit, out=out, logs=logs, deadline=time.monotonic() + 600,
                          gpu="Fake GPU (sm_90, 1 SMs, 1 GiB)")
    assert gpu_kit.stage_sweep(ctx, 60).startswith("2 variants of 1 rows byte-equal")
    section = ctx.sections["sweep"]
    assert section.startswith("- device: Fake GPU")
    assert "- device-to-device copy: 4000.0 GB/s" in section
    assert "| `u1t256m6 g4` (fastest) (chosen) |" in section and "sweep-json" not in section
    assert f"report: {gpu_kit.report_name(ctx)}" in section
    assert json.loads((out / "sweep.json").read_text()) == ctx.sweep
    assert ctx.facts["copy (sweep stage)"] == "4000.0 GB/s on Fake GPU"

    summary = gpu_kit.stage_ncu(ctx, 60)
    assert summary == "1 of 1 rows profiled with the sweep's chosen variants: issue active " \
                      "32-32%, DRAM 88-88% of peak", summary
    seen = json.loads((tmp_path / "ncu-args.json").read_text())
    assert seen["variants"] == "global_dequantize_i8__n__u1t256m6:4"
    args = seen["args"]
    assert args[:2] == ["--clock-control", "none"], args
    assert args[args.index("--kernel-name") + 1] == \
        "regex:^(global_dequantize_i8__n__u1t256m6)$"
    assert args[args.index("--launch-count") + 1] == "1"
    row = next(line for line in ctx.sections["ncu"].splitlines() if line.startswith("| (8c)"))
    # 25 us; 4,194,304 warp instructions over 16 Mi elements; stalls without `selected`; DRAM
    # bytes over the row's 80 MiB.
    assert row == ("| (8c) | `global_dequantize_i8__n__u1t256m6` | 4 | 25.0 | 0.250 | 31.5 | "
                   "long_scoreboard 12.50, wait 2.25, lg_throttle 0.75 | 88.2 | 1.00 | 30 | "
                   "75.5 |"), row

    monkeypatch.setenv("FAKE_NCU_REFUSE", "1")
    with pytest.raises(gpu_kit.Skip, match="counters here: ==ERROR== ERR_NVGPUCTRPERM"):
        gpu_kit.stage_ncu(ctx, 60)
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.setattr(gpu_kit, "find_ncu", lambda: None)
    with pytest.raises(gpu_kit.Skip, match="ncu .* is not on PATH"):
        gpu_kit.stage_ncu(ctx, 60)


def test_ncu_figures_in_base_units():
    assert gpu_kit.base_value("25.00", "usecond") == 25_000
    assert gpu_kit.base_value("16.78", "Mbyte") == pytest.approx(16.78e6)
    assert gpu_kit.base_value("4,194,304", "inst") == 4_194_304
    assert gpu_kit.base_value("31.5", "%") == 31.5
    csv_text = ('==PROF== noise\n"ID","Kernel Name","gpu__time_duration.sum"\n'
                '"","","usecond"\n"0","k__n__u1t256m6","2.5"\n')
    parsed = gpu_kit.parse_ncu_csv(csv_text)
    assert parsed == {"k__n__u1t256m6": {"ID": 0.0, "gpu__time_duration.sum": 2500.0}}
    assert gpu_kit.parse_ncu_csv("no csv here") == {}
    # Without a sweep, every specialised entry point matches, one launch per row.
    variants, names, count = gpu_kit.ncu_targets(None)
    assert variants == "" and count == gpu_kit.KERNEL_ROWS == 13
    assert re.match(names.removeprefix("regex:"), "grad_quantize_first__b8g128sr_h32__u4t256m3")
    assert not re.match(names.removeprefix("regex:"), "some_other_kernel")
    for refusal in ("==ERROR== Failed to initialize the profiler: LibraryNotLoaded",
                    "==ERROR== ERR_NVGPUCTRPERM - The user does not have permission"):
        assert gpu_kit.NCU_NO_COUNTERS.search(refusal), refusal

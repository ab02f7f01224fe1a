"""The GPU kit (scripts/gpu_kit.sh, scripts/gpu_kit.py): the prepared folder holds every part
within its size limit, its dry run on a host without a GPU skips every GPU stage saying why
and exits with the documented status, and the report's pieces (the benchmark table joined with
the static model, the cost of compression against a GEMM step) are computed right."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import tarfile
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
    with tarfile.open(out / "logs.tar.gz") as tar:
        names = tar.getnames()
    assert "logs/build.log" in names and "logs/prebuilt.log" in names, names
    assert sorted(p.name for p in out.iterdir()) == ["logs.tar.gz", "report.md"]


def test_report_joins_the_benchmark_with_the_static_model():
    hbm, estimates = gpu_kit.model_estimates()
    assert hbm == 3.35 and estimates["grad_quantize_first"].endswith("%"), (hbm, estimates)
    table = "\n".join([
        "| row | kernel | read MiB | written MiB | median us | min us | GB/s | x copy | target |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|",
        "| baseline: copy | - | 1 | 1 | 1 | 1 | 3015.0 | 1.00 | - |",
        "| (1) grad first | grad_quantize_first | 1 | 1 | 1 | 1 | 670.0 | 0.22 | met |"])
    joined = gpu_kit.with_model_estimates(table).splitlines()
    assert joined[0].endswith("| of HBM (3.35 TB/s) | model (kernels.md) |")
    assert joined[1].endswith("|---:|---:|")
    assert joined[2].endswith("| 90% | - |")
    assert joined[3].endswith(f"| 20% | {estimates['grad_quantize_first']} |")


def test_cost_against_a_gemm_step():
    output = ("noise\ncost-json: " + json.dumps({
        "device": "X", "preset": "sdp4bit", "world": "2x2",
        "rows": [{"numel": 64 << 20, "grad": "fp32", "reduce_scatter_ms": 1.5,
                  "all_gather_ms": 0.5}]}) + "\n")
    costs = gpu_cost.parse_costs(output)
    hidden = gpu_cost.layer_hidden(64 << 20)
    assert hidden % 64 == 0 and abs(12 * hidden**2 / (64 << 20) - 1) < 0.02
    rows, fractions = gpu_cost.table(costs, 8192, {hidden: 10.0})
    assert fractions == [0.2]
    assert rows[-1].endswith("| 1.500 + 0.500 | 20.0% |"), rows[-1]
    with pytest.raises(ValueError, match="no cost-json line"):
        gpu_cost.parse_costs("nothing")


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

"""The GPU kit's runner (docs/gpu-kit.md). Standard library only: it runs on the GPU host's own
python3 (3.12, torch 2.11) and on the CPU machines, and every stage that needs torch, the GPU
or the kit runs in a subprocess of its own, under its own time limit.

    python3 scripts/gpu_kit.py manifest --kit DIR [--max-mib N]   (scripts/gpu_kit.sh prepare)
    python3 scripts/gpu_kit.py run --out DIR [--kit DIR] [--deadline SECONDS] [--only a,b]

`run` writes DIR/report.md (every stage PASS / FAIL / SKIP with its reason and time, the
versions, the sweep's, the benchmark's, ncu's and the stream check's figures) and
DIR/logs.tar.gz (each stage's full output; ncu's report too), beside bench_gpu.md, cost.md and
sweep.json where those stages ran, and exits with 0 when every stage that ran passed, 1 when
one failed, 2 on a host without a usable GPU (the GPU stages are skipped, saying why). Stages
run in order of value; one that fails does not stop the next, and a stage is skipped once the
deadline would not leave it its time.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import csv
import ctypes
import datetime
import hashlib
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_KIT = ROOT / ".cache" / "gpu-kit"

EXIT_PASSED, EXIT_FAILED, EXIT_NO_GPU = 0, 1, 2

#: The kit's parts, relative to its folder (scripts/gpu_kit.sh prepare builds them).
BINARIES = ("bin/cuda_gpu", "bin/cuda_gpu_collectives", "bin/bench_gpu")
NATIVE_LIB = "native/lib/libsdp4bit.a"
SITE = "site"
WHEELS = "wheels"
MANIFEST = "MANIFEST.json"

#: What the kit's binaries and prebuilt package are built from (path, file suffixes): the
#: manifest records their hash, so a run can tell a kit prepared from another tree. The files
#: the host runs from the tree itself (the Python tests, the examples, this runner) are not
#: in it.
SOURCES = (("Cargo.toml", ""), ("Cargo.lock", ""), ("build.rs", ""), ("setup.py", ""),
           ("scripts/build_native.py", ""), ("src", ".rs"), ("cpp", ".h .cpp"),
           ("kernels", ".h .cu .cuh"), ("bench", ".rs"), ("tests", ".rs .toml"),
           ("sdp4bit", ".py"), ("megatron_patch", ".py"))

#: Lines of a failed stage's log the report quotes.
TAIL_LINES = 15
#: The GPU benchmark's kernel rows (bench/gpu.rs, `kernel_rows`).
KERNEL_ROWS = 13


# ---------------------------------------------------------------------------------------------
# The manifest.

def source_hash(root: Path = ROOT) -> str:
    """One hash of the kit's sources as they are in `root` (paths and contents)."""
    digest = hashlib.sha256()
    for top, suffixes in SOURCES:
        base = root / top
        files = [base] if base.is_file() else sorted(
            p for p in base.rglob("*") if p.is_file() and p.suffix in suffixes.split())
        for path in files:
            digest.update(str(path.relative_to(root)).encode() + b"\0")
            digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


def kit_files(kit: Path) -> dict[str, int]:
    """Every file of the kit but the manifest, with its size."""
    return {str(p.relative_to(kit)): p.stat().st_size for p in sorted(kit.rglob("*"))
            if p.is_file() and p.name != MANIFEST}


def missing_parts(kit: Path) -> list[str]:
    """The parts a prepared kit must hold that `kit` lacks."""
    wanted = [*BINARIES, NATIVE_LIB, "native/include/sdp4bit/cpp/torch_comms.h"]
    missing = [part for part in wanted if not (kit / part).is_file()]
    if not list((kit / SITE / "sdp4bit").glob("_sdp4bit*.so")):
        missing.append(f"{SITE}/sdp4bit/_sdp4bit*.so")
    if not list((kit / WHEELS).glob("megatron_core-*.whl")):
        missing.append(f"{WHEELS}/megatron_core-*.whl")
    return missing


def write_manifest(kit: Path, max_mib: float) -> int:
    """Checks the prepared kit and records what it is; prints its size. 1 when a part is
    missing or it is over `max_mib`."""
    missing = missing_parts(kit)
    if missing:
        print(f"the kit in {kit} lacks: {', '.join(missing)}", file=sys.stderr)
        return 1
    files = kit_files(kit)
    total = sum(files.values())
    built_with = (kit / SITE / "sdp4bit").glob("_sdp4bit*.torch-version")
    manifest = {
        "prepared": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": _git("rev-parse", "HEAD"),
        "uncommitted_changes": bool(_git("status", "--porcelain", "--untracked-files=no")),
        "sources_sha256": source_hash(),
        "python": platform.python_version(),
        "torch": next((p.read_text().strip() for p in built_with), "unknown"),
        "files": files,
        "total_bytes": total,
    }
    (kit / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    mib = total / 2**20
    print(f"GPU kit: {kit} holds {len(files)} files, {mib:.1f} MiB (limit {max_mib:g} MiB)")
    for name, size in sorted(files.items(), key=lambda item: -item[1])[:8]:
        print(f"  {size / 2**20:7.2f} MiB  {name}")
    if mib > max_mib:
        print(f"the kit is over its {max_mib:g} MiB", file=sys.stderr)
        return 1
    return 0


def _git(*args: str) -> str:
    done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=False)
    return done.stdout.strip() if done.returncode == 0 else ""


# ---------------------------------------------------------------------------------------------
# Stages.

class Skip(Exception):
    """A stage that cannot run here, and why."""


class Fail(Exception):
    """A stage that ran and failed, and why (the log holds the rest)."""


@dataclass
class Outcome:
    name: str
    status: str  # PASS, FAIL or SKIP
    seconds: float
    summary: str
    log: str = ""


@dataclass
class Context:
    """What the stages share: the kit, the output and log folders, the deadline and what
    earlier stages found."""

    kit: Path
    out: Path
    logs: Path
    deadline: float
    gpu: str | None = None  # the GPU's name, None without one
    no_gpu_reason: str = ""
    site: Path | None = None  # where sdp4bit is importable from
    nvrtc_dirs: str = ""  # SDP4BIT_NVRTC_DIRS as the package sets it
    facts: dict[str, str] = field(default_factory=dict)
    sections: dict[str, str] = field(default_factory=dict)
    sweep: dict | None = None  # the sweep's sweep-json, once its stage has run

    def seconds_left(self) -> float:
        return self.deadline - time.monotonic()

    def env(self, **extra: str) -> dict[str, str]:
        """The stages' environment: sdp4bit (and the test helpers) importable, NVRTC found,
        output unbuffered, a GPU required where there is one."""
        env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONDONTWRITEBYTECODE="1")
        paths = [str(self.site)] if self.site else []
        paths += [str(ROOT / "tests" / "python"), str(ROOT / "megatron_on_cpu")]
        env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in [env.get("PYTHONPATH")] if p])
        if self.nvrtc_dirs:
            env.setdefault("SDP4BIT_NVRTC_DIRS", self.nvrtc_dirs)
        if self.gpu:
            env["SDP4BIT_REQUIRE_GPU"] = "1"
        env.update(extra)
        return env

    def run(self, stage: str, args: list[str], limit: float, env: dict[str, str] | None = None,
            cwd: Path = ROOT) -> tuple[int, str]:
        """Runs `args` (its own process group, killed at `limit` seconds), appending its output
        to the stage's log; returns the exit status (124 on timeout) and the output."""
        log = self.logs / f"{stage}.log"
        with log.open("a") as f:
            f.write(f"$ {' '.join(args)}\n")
            f.flush()
            start = time.monotonic()
            proc = subprocess.Popen(args, cwd=cwd, env=env or self.env(), stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True, errors="replace",
                                    start_new_session=True)
            try:
                output, _ = proc.communicate(timeout=limit)
                status = proc.returncode
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                output, _ = proc.communicate()
                output += f"\n[killed after {limit:.0f} s]\n"
                status = 124
            f.write(output)
            f.write(f"[exit {status} after {time.monotonic() - start:.1f} s]\n\n")
        return status, output


@dataclass(frozen=True)
class Stage:
    name: str
    what: str
    limit: float
    needs_gpu: bool
    body: Callable[[Context, float], str]


def last_line(output: str, pattern: str) -> str:
    """The last line of `output` matching `pattern`, or ''."""
    found = [line.strip() for line in output.splitlines() if re.search(pattern, line)]
    return found[-1] if found else ""


def checked(status: int, output: str, what: str, pattern: str) -> str:
    """The summary line of a command that must have exited 0."""
    summary = last_line(output, pattern)
    if status == 124:
        raise Fail(f"{what}: out of time ({summary or 'no summary line'})")
    if status != 0:
        raise Fail(f"{what} exited with {status}: {summary or last_line(output, '.')}")
    return summary


# Stage bodies: each gets the context and its time limit; returns a one-line summary, raises
# Skip or Fail.

def stage_host(ctx: Context, limit: float) -> str:
    manifest_path = ctx.kit / MANIFEST
    if not manifest_path.is_file():
        raise Fail(f"no kit at {ctx.kit} (run `bash scripts/gpu_kit.sh prepare` first)")
    manifest = json.loads(manifest_path.read_text())
    stale = manifest["sources_sha256"] != source_hash()
    commit = manifest["commit"][:12] + (" + changes" if manifest["uncommitted_changes"] else "")
    ctx.facts["kit"] = (f"prepared {manifest['prepared']} from {commit or 'no git'}, "
                        f"{manifest['total_bytes'] / 2**20:.1f} MiB, extension built under "
                        f"Python {manifest['python']} / torch {manifest['torch']}")
    ctx.facts["python"] = f"{platform.python_version()} ({sys.executable})"
    ctx.facts["host"] = f"{platform.platform()}, {os.cpu_count()} CPUs"
    smi = ""
    if shutil.which("nvidia-smi"):
        status, output = ctx.run("host", ["nvidia-smi", "--query-gpu=name,driver_version,"
                                          "memory.total,clocks.max.sm,clocks.max.mem",
                                          "--format=csv,noheader"], min(limit, 30))
        smi = output.strip().splitlines()[0] if status == 0 and output.strip() else ""
    if smi:
        ctx.facts["nvidia-smi"] = smi
    probe = (
        "import json, torch\n"
        "d = {'torch': torch.__version__, 'cuda_runtime': torch.version.cuda,\n"
        "     'gpus': torch.cuda.device_count() if torch.cuda.is_available() else 0}\n"
        "if d['gpus']:\n"
        "    p = torch.cuda.get_device_properties(0)\n"
        "    d['gpu'] = f'{p.name} (sm_{p.major}{p.minor}, {p.multi_processor_count} SMs, '"
        " f'{p.total_memory / 2**30:.0f} GiB)'\n"
        "    d['nccl'] = '.'.join(map(str, torch.cuda.nccl.version()))\n"
        "print('probe-json: ' + json.dumps(d))\n")
    status, output = ctx.run("host", [sys.executable, "-c", probe], min(limit, 60))
    line = last_line(output, r"^probe-json: ")
    if status != 0 or not line:
        ctx.no_gpu_reason = f"torch is not usable here: {last_line(output, '.')}"
        raise Fail(ctx.no_gpu_reason)
    found = json.loads(line.split(": ", 1)[1])
    ctx.facts["torch"] = f"{found['torch']} (CUDA runtime {found['cuda_runtime'] or 'none'})"
    if found.get("nccl"):
        ctx.facts["NCCL"] = found["nccl"]
    if found["gpus"]:
        ctx.gpu = found["gpu"]
        ctx.facts["GPU"] = f"{found['gpu']}, {found['gpus']} visible"
    else:
        ctx.no_gpu_reason = (f"torch {found['torch']} sees no CUDA GPU"
                             + ("" if smi else " and nvidia-smi found none"))
    if stale:
        raise Fail("the kit was prepared from other sources than this tree's (prepare it again): "
                   "its binaries and extension are not this tree's")
    return f"{ctx.gpu or 'no GPU'}; kit {commit or '(no git)'}"


#: What a fresh interpreter runs to show the extension loads and works: the core's schema, and
#: the in-process reduce-scatter of 4 virtual ranks (CPU) through the extension, uncompressed
#: (bit for bit the sum in rank order) and with the sdp4bit preset (finite).
LOAD_CHECK = (
    "import os, torch, sdp4bit\n"
    "from sdp4bit import _native\n"
    "x = torch.randn(4, 4096)\n"
    "def reduce(preset):\n"
    "    spec = sdp4bit.Config(preset).spec()\n"
    "    return torch.ops.sdp4bit.simulate_grad_reduce_scatter(spec, [0, 0, 1, 1], 0, 0, x)\n"
    "exact = ((x[0] + x[1]) + x[2]) + x[3]\n"
    "assert torch.equal(reduce('baseline').reshape(-1), exact), 'baseline differs'\n"
    "assert torch.isfinite(reduce('sdp4bit')).all(), 'sdp4bit not finite'\n"
    "print('loaded', _native.__file__, 'presets', len(_native.schema()['presets']),"
    " 'baseline reduce-scatter exact')\n"
    "print('nvrtc-dirs:', os.environ[_native.NVRTC_DIRS_VAR])\n"
    "print('nvrtc:', torch.ops.sdp4bit.nvrtc_report())\n")


def adopt(ctx: Context, site: Path, output: str) -> None:
    """Makes `site` the package the later stages import, and hands the package's NVRTC search
    (sdp4bit._native, as a training process does it) to the Rust binaries, which have no
    Python."""
    ctx.site = site
    ctx.nvrtc_dirs = last_line(output, r"^nvrtc-dirs: ").removeprefix("nvrtc-dirs:").strip()
    ctx.facts["NVRTC"] = last_line(output, r"^nvrtc: ").removeprefix("nvrtc:").strip()


def python_symbols(library: Path) -> list[str]:
    """The Python C API symbols `library` needs from the interpreter (nm -D)."""
    done = subprocess.run(["nm", "-D", "--undefined-only", str(library)], capture_output=True,
                          text=True, check=False)
    return sorted({line.split()[-1] for line in done.stdout.splitlines()
                   if re.search(r"\s_?Py", line)})


def stage_prebuilt(ctx: Context, limit: float) -> str:
    site = ctx.kit / SITE
    library = next((site / "sdp4bit").glob("_sdp4bit*.so"), None)
    if library is None:
        raise Fail(f"no prebuilt extension in {site}")
    absent = [s for s in python_symbols(library) if not hasattr(ctypes.pythonapi, s)]
    if absent:
        raise Fail(f"Python {platform.python_version()} lacks {', '.join(absent)}")
    status, output = ctx.run("prebuilt", [sys.executable, "-c", LOAD_CHECK], limit,
                             env=dict(ctx.env(), PYTHONPATH=str(site)),
                             cwd=Path(tempfile.gettempdir()))
    summary = checked(status, output, "loading the prebuilt extension", r"^loaded ")
    adopt(ctx, site, output)
    return f"under Python {platform.python_version()}: {summary}"


def stage_build(ctx: Context, limit: float) -> str:
    """Builds the extension from the kit's native bundle against this host's torch and
    Python, into a fresh folder, and loads it in a fresh interpreter."""
    target = Path(tempfile.mkdtemp(prefix="sdp4bit-site-"))
    env = ctx.env(SDP4BIT_NATIVE_DIR=str(ctx.kit / "native"), CARGO="/nonexistent/cargo",
                  MAX_JOBS=str(os.cpu_count() or 4))
    env.pop("PYTHONPATH", None)
    shutil.rmtree(ROOT / "build", ignore_errors=True)
    status, output = ctx.run("build", [sys.executable, "-m", "pip", "install", "--no-deps",
                                       "--no-build-isolation", "--no-index", "--no-compile",
                                       "--target", str(target), str(ROOT)], limit, env=env)
    checked(status, output, "pip install with the native bundle", r".")
    status, output = ctx.run("build", [sys.executable, "-c", LOAD_CHECK], 60,
                             env=dict(env, PYTHONPATH=str(target)),
                             cwd=Path(tempfile.gettempdir()))
    summary = checked(status, output, "loading the extension built here", r"^loaded ")
    if ctx.site is None:
        adopt(ctx, target, output)
    return f"built against {ctx.facts.get('torch', 'this torch')} under Python " \
           f"{platform.python_version()}; {summary}"


def stage_selftest(ctx: Context, limit: float) -> str:
    status, output = ctx.run("selftest", [sys.executable, "-m", "sdp4bit.selftest",
                                          "--no-source"], limit, cwd=Path(tempfile.gettempdir()))
    ctx.sections["selftest"] = output.strip()
    return checked(status, output, "python -m sdp4bit.selftest", r"^result: ")


def rust_tests(binary: str, name: str) -> Callable[[Context, float], str]:
    def body(ctx: Context, limit: float) -> str:
        status, output = ctx.run(name, [str(ctx.kit / binary)], limit)
        # SDP4BIT_REQUIRE_GPU=1 (ctx.env) makes a test that finds no GPU fail, not skip.
        return checked(status, output, binary, r"^test result: ")
    return body


def stage_torch_cuda(ctx: Context, limit: float) -> str:
    status, output = ctx.run("torch-cuda", [sys.executable, "-P", "-m", "pytest", "-q", "-rs", "-s",
                                            "-p", "no:cacheprovider",
                                            "tests/python/test_cuda.py"], limit)
    evidence = [line.strip() for line in output.splitlines() if "stream-evidence:" in line]
    if evidence:
        ctx.sections["stream"] = "\n".join(evidence)
    summary = checked(status, output, "pytest tests/python/test_cuda.py", r"(passed|failed|error)")
    # One GPU skips only the tests that need several; any other skip hides a check.
    skips = re.findall(r"^SKIPPED \[\d+\] \S+: (.*)$", output, re.M)
    unexpected = [reason for reason in skips if not re.search(r"needs \d+ GPUs", reason)]
    if unexpected:
        raise Fail(f"tests skipped on a GPU host: {'; '.join(unexpected)}")
    return summary


def bench_env(ctx: Context, sections: str, **extra: str) -> dict[str, str]:
    """The GPU benchmark's environment: its sections, and cuBLAS on the loader's path (the
    `concurrent` section loads it at run time)."""
    paths = [*cublas_dirs(), *filter(None, [os.environ.get("LD_LIBRARY_PATH")])]
    return ctx.env(SDP4BIT_BENCH_SECTIONS=sections, LD_LIBRARY_PATH=os.pathsep.join(paths),
                   **extra)


def cublas_dirs() -> list[str]:
    """The folders holding a cuBLAS the benchmark can load: the ones torch's wheels ship
    (site-packages/nvidia/*/lib), then the CUDA toolkit's."""
    roots = [Path(p) for p in sys.path if p and Path(p).is_dir()]
    found = [lib for root in roots for lib in sorted(root.glob("nvidia/*/lib/libcublas.so*"))]
    for pattern in ("usr/local/cuda*/lib64/libcublas.so*",
                    "usr/local/cuda*/targets/*/lib/libcublas.so*"):
        found += sorted(Path("/").glob(pattern))
    return list(dict.fromkeys(str(lib.parent) for lib in found))


def json_line(output: str, prefix: str) -> dict | None:
    """The JSON of the last line of `output` starting with `prefix` (`cost-json: `, ...)."""
    line = last_line(output, "^" + re.escape(prefix))
    return json.loads(line[len(prefix):]) if line else None


def stage_bench(ctx: Context, limit: float) -> str:
    status, output = ctx.run("bench", [str(ctx.kit / "bin/bench_gpu")], limit,
                             env=bench_env(ctx, "kernels,cost,concurrent"))
    table = output[output.find("# sdp4bit GPU benchmark"):] if "# sdp4bit" in output else ""
    if table:
        (ctx.out / "bench_gpu.md").write_text(table)
        ctx.sections["bench"] = with_model_estimates(table)
    summary = checked(status, output, "the GPU benchmark", r"kernels reach")
    concurrent = json_line(output, "concurrent-json: ") or {}
    rows = concurrent.get("rows") or []
    if rows:
        slowdowns = ", ".join(f"{100 * (r['gemm_beside_ms'] / r['gemm_ms'] - 1):+.1f}% "
                              f"({r['grad']})" for r in rows)
        summary += f" A GEMM step beside the compression kernels: {slowdowns}."
    elif concurrent.get("skipped"):
        summary += f" GEMM beside compression skipped: {concurrent['skipped']}."
    return summary


def report_name(ctx: Context) -> str:
    """The name this run's report is to be committed under (bench/results/gpu/), which the
    sweep's `TABLE` lines cite: the date and the GPU."""
    gpu = (ctx.gpu or "gpu").split(" (")[0].lower().removeprefix("nvidia ")
    slug = re.sub(r"[^a-z0-9]+", "-", gpu).strip("-")
    date = datetime.datetime.now(datetime.timezone.utc).date().isoformat()
    return f"bench/results/gpu/{date}-{slug}-kit.md"


def stage_sweep(ctx: Context, limit: float) -> str:
    """The benchmark's sweep section: its tables into the report, its sweep-json kept for the
    ncu stage (and as sweep.json beside the report)."""
    name = report_name(ctx)
    status, output = ctx.run("sweep", [str(ctx.kit / "bin/bench_gpu")], limit,
                             env=bench_env(ctx, "sweep", SDP4BIT_BENCH_REPORT=name))
    start = output.find("## Sweep of the kernel variants")
    if start >= 0:
        measured = [last_line(output, r"^- device: "),
                    last_line(output, r"^- device-to-device copy: ")]
        body = [line for line in output[start:].strip().splitlines()[1:]
                if not line.startswith("sweep-json: ")]
        ctx.sections["sweep"] = "\n".join([*filter(None, measured), *body])
        ctx.facts["variant table's report"] = f"`{name}` (commit this report there)"
    ctx.sweep = json_line(output, "sweep-json: ")
    if ctx.sweep:
        (ctx.out / "sweep.json").write_text(json.dumps(ctx.sweep, indent=1) + "\n")
        ctx.facts["copy (sweep stage)"] = (f"{ctx.sweep['copy_gbps']:.1f} GB/s on "
                                           f"{ctx.sweep['device']}")
    summary = checked(status, output, "the sweep", r"^sweep: ")
    if status == 0 and not ctx.sweep:
        raise Fail("the sweep printed no sweep-json line")
    return summary.removeprefix("sweep: ")


#: ncu's sections and metrics for each row: the warp states (stall reasons), the scheduler
#: (issue active), speed of light (DRAM throughput), launch and occupancy figures, and the
#: counts the table divides.
NCU_SECTIONS = ("SpeedOfLight", "WarpStateStats", "SchedulerStats", "LaunchStats", "Occupancy")
NCU_METRICS = ("smsp__inst_executed.sum", "smsp__issue_active.avg.pct_of_peak_sustained_active",
               "dram__throughput.avg.pct_of_peak_sustained_elapsed", "dram__bytes_read.sum",
               "dram__bytes_write.sum", "gpu__time_duration.sum")
#: What ncu says where it cannot read the GPU's performance counters (no permission, a
#: sandboxed driver such as gVisor's): the stage is skipped, naming the error.
NCU_NO_COUNTERS = re.compile(r"ERR_NVGPUCTRPERM|LibraryNotLoaded|Failed to initialize the "
                             r"profiler|[Pp]rofiling is not supported|not supported on this "
                             r"(device|platform)|permission to access NVIDIA GPU Performance",
                             re.I)
#: Stall reasons of the warp-state section, per issued instruction.
STALL = re.compile(r"^smsp__average_warps?_issue_stalled_(\w+?)_per_issue_active\.ratio$")


def find_ncu() -> str | None:
    """Nsight Compute's command line: on PATH, in the CUDA toolkit or in its own folder."""
    found = shutil.which("ncu")
    if found:
        return found
    for pattern in ("usr/local/cuda*/bin/ncu", "opt/nvidia/nsight-compute/*/ncu"):
        hits = sorted(Path("/").glob(pattern), reverse=True)
        if hits:
            return str(hits[0])
    return None


def ncu_targets(sweep: dict | None) -> tuple[str, str, int]:
    """What the profile run launches and ncu matches: `SDP4BIT_BENCH_VARIANTS` (each row's
    chosen variant from the sweep, none without one), the kernel-name regex and the launch
    count (one launch per row)."""
    rows = (sweep or {}).get("rows") or []
    if not rows:
        return "", r"regex:^\w+__\w+__u\d+t\d+m\d+$", KERNEL_ROWS
    chosen = [r["chosen"] for r in rows]
    variants = ",".join(f"{c['entry']}:{c['grid_blocks']}" for c in chosen)
    names = "|".join(dict.fromkeys(re.escape(c["entry"]) for c in chosen))
    return variants, f"regex:^({names})$", len(rows)


def base_value(value: str, unit: str) -> float:
    """A metric of ncu's CSV in base units (bytes, nanoseconds, counts)."""
    number = float(value.replace(",", ""))
    scale = {"K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
    if unit.endswith("second"):
        return number * {"n": 1, "u": 1e3, "m": 1e6, "": 1e9}[unit[:-len("second")]]
    if unit[:1] in scale and unit[1:] in ("byte", "inst", "cycle", "warp"):
        return number * scale[unit[0]]
    return number


def parse_ncu_csv(text: str) -> dict[str, dict[str, float]]:
    """ncu's raw page as CSV (`--csv --page raw`): by kernel name, each numeric metric in base
    units (the second row gives the units)."""
    lines = [line for line in text.splitlines() if line.startswith('"')]
    rows = list(csv.reader(lines))
    if len(rows) < 2 or "Kernel Name" not in rows[0]:
        return {}
    header, units = rows[0], rows[1]
    out: dict[str, dict[str, float]] = {}
    for row in rows[2:]:
        record = dict(zip(header, row))
        name = record.get("Kernel Name", "").split("(")[0].strip()
        metrics = {}
        for key, value, unit in zip(header, row, units):
            try:
                metrics[key] = base_value(value, unit)
            except (ValueError, KeyError):
                continue
        out[name] = metrics
    return out


def ncu_table(profile: dict, metrics: dict[str, dict[str, float]]) -> tuple[list[str], int]:
    """The markdown rows of the ncu section, one per profiled row (`profile-json`), and how
    many of them ncu measured."""
    lines = ["| row | entry point | grid/SM | us (ncu) | warp inst / element | issue active % "
             "| top stalls (cycles per issued inst) | DRAM % of peak | DRAM bytes / counted "
             "| registers | occupancy % |",
             "|---|---|---:|---:|---:|---:|---|---:|---:|---:|---:|"]
    found = 0
    for row in profile.get("rows", []):
        m = metrics.get(row["entry"])
        if m is None:
            lines.append(f"| {row['row']} | `{row['entry']}` | {row['grid_blocks']} | not "
                         "profiled | - | - | - | - | - | - | - |")
            continue
        found += 1
        stalls = sorted(((value, STALL.match(key).group(1)) for key, value in m.items()
                         if STALL.match(key) and not key.endswith("_selected_per_issue_active"
                                                                  ".ratio")), reverse=True)
        dram = (m["dram__bytes_read.sum"] + m["dram__bytes_write.sum"]
                if "dram__bytes_read.sum" in m and "dram__bytes_write.sum" in m else None)
        inst = m.get("smsp__inst_executed.sum")
        time_ns = m.get("gpu__time_duration.sum")
        cells = [
            time_ns / 1e3 if time_ns is not None else None,
            inst / row["elements"] if inst is not None and row["elements"] else None,
            m.get("smsp__issue_active.avg.pct_of_peak_sustained_active"),
            None,
            m.get("dram__throughput.avg.pct_of_peak_sustained_elapsed"),
            dram / row["bytes"] if dram is not None and row["bytes"] else None,
            m.get("launch__registers_per_thread"),
            m.get("sm__warps_active.avg.pct_of_peak_sustained_active"),
        ]
        formats = ["{:.1f}", "{:.3f}", "{:.1f}", "", "{:.1f}", "{:.2f}", "{:.0f}", "{:.1f}"]
        text = ["-" if v is None else f.format(v) for v, f in zip(cells, formats)]
        text[3] = ", ".join(f"{name} {value:.2f}" for value, name in stalls[:3]) or "-"
        lines.append(f"| {row['row']} | `{row['entry']}` | {row['grid_blocks']} | "
                     + " | ".join(text) + " |")
    return lines, found


def model_estimates() -> dict[str, tuple[float, float, float]]:
    """The kernel model's terms per bench row, from bench/results/kernels.md ("Model terms per
    bench row"): by the row's tag ("(1)", "(1b)", ...), its bytes read + written and its issue
    and serial bounds in microseconds, which do not depend on the GPU's memory."""
    text = (ROOT / "bench" / "results" / "kernels.md").read_text()
    rows = re.findall(r"^\| (\(\w+\)) \| `\w+` \| (\d+) \| ([\d.]+) \| ([\d.]+) \|$", text, re.M)
    return {tag: (float(b), float(issue), float(serial)) for tag, b, issue, serial in rows}


def with_model_estimates(table: str) -> str:
    """The benchmark's kernel table with, beside each row, the kernel model's prediction for
    this run (the largest of the row's bytes over this run's copy bandwidth, its issue bound
    and its serial bound) and the measured median over it."""
    estimates = model_estimates()
    copy_gbps = None
    lines = []
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| row |"):
            line += " model us (kernels.md, this copy) | measured / model |"
        elif line.startswith("|---") and len(cells) == 9:
            line += "---:|---:|"
        elif line.startswith("| baseline") and len(cells) == 9:
            copy_gbps = float(cells[6])
            line += " - | - |"
        elif line.startswith("| (") and len(cells) == 9:
            terms = estimates.get(cells[0].split()[0])
            if terms is None or copy_gbps is None:
                line += " - | - |"
            else:
                nbytes, issue_us, serial_us = terms
                model_us = max(nbytes / (copy_gbps * 1e3), issue_us, serial_us)
                line += f" {model_us:.1f} | {float(cells[4]) / model_us:.2f} |"
        lines.append(line)
    return "\n".join(lines)


def stage_ncu(ctx: Context, limit: float) -> str:
    """`ncu --clock-control none` over the benchmark's profile section, which launches each
    kernel row once with the variant the sweep chose (the production one without a sweep)."""
    ncu = find_ncu()
    if ncu is None:
        raise Skip("ncu (Nsight Compute) is not on PATH nor under /usr/local/cuda*/bin or "
                   "/opt/nvidia/nsight-compute")
    variants, names, count = ncu_targets(ctx.sweep)
    report = ctx.logs / "ncu.ncu-rep"
    command = [ncu, "--clock-control", "none", "--kernel-name", names, "--launch-count",
               str(count)]
    for section in NCU_SECTIONS:
        command += ["--section", section]
    target = ["--export", str(report), "--force-overwrite", str(ctx.kit / "bin/bench_gpu")]
    env = bench_env(ctx, "profile", SDP4BIT_BENCH_VARIANTS=variants)
    started = time.monotonic()
    status, output = ctx.run("ncu", [*command, "--metrics", ",".join(NCU_METRICS), *target],
                             max(10.0, limit - 30), env=env)
    errors = [line.strip() for line in output.splitlines() if line.startswith("==ERROR==")]
    if status != 0 and any(re.search(r"metric", line, re.I) for line in errors):
        # An ncu that does not know one of the metrics asked for by name: the sections alone
        # (their own metrics, which every ncu knows) still give most of the table.
        left = limit - 30 - (time.monotonic() - started)
        status, output = ctx.run("ncu", [*command, *target], max(10.0, left), env=env)
        errors = [line.strip() for line in output.splitlines() if line.startswith("==ERROR==")]
    refused = next((line for line in errors if NCU_NO_COUNTERS.search(line)), None)
    if refused:
        raise Skip(f"ncu cannot read the GPU's performance counters here: {refused}")
    profile = json_line(output, "profile-json: ")
    if status != 0 or profile is None or not report.is_file():
        why = errors[0] if errors else last_line(output, ".")
        raise Fail(f"ncu over the benchmark's profile launches exited with {status}: {why}")
    status, csv_text = ctx.run("ncu", [ncu, "--import", str(report), "--csv", "--page", "raw",
                                       "--print-units", "base"], 60)
    if status != 0:
        status, csv_text = ctx.run("ncu", [ncu, "--import", str(report), "--csv", "--page",
                                           "raw"], 60)
    metrics = parse_ncu_csv(csv_text)
    lines, found = ncu_table(profile, metrics)
    chosen = "the sweep's chosen variants" if variants else "the production variants (no sweep)"
    ctx.sections["ncu"] = "\n".join([
        f"`ncu --clock-control none` (the GPU's own clocks), one launch of each kernel row with "
        f"{chosen}, {len(profile['rows'])} rows; sections "
        f"{', '.join(NCU_SECTIONS)}. Warp instructions per element: smsp__inst_executed.sum over "
        "the elements the call processes; issue active: "
        "smsp__issue_active.avg.pct_of_peak_sustained_active; stalls: "
        "smsp__average_warps_issue_stalled_*_per_issue_active.ratio (cycles a warp waits per "
        "issued instruction, the three largest); DRAM: "
        "dram__throughput.avg.pct_of_peak_sustained_elapsed, and the DRAM bytes ncu counted "
        "over the bytes the row counts.", "", *lines])
    if not found:
        raise Fail(f"ncu profiled none of the {len(profile['rows'])} launches "
                   f"({last_line(output, 'No kernels were profiled') or 'no metrics read'})")
    issue_key = "smsp__issue_active.avg.pct_of_peak_sustained_active"
    dram_key = "dram__throughput.avg.pct_of_peak_sustained_elapsed"
    issue = [m[issue_key] for m in metrics.values() if issue_key in m]
    dram = [m[dram_key] for m in metrics.values() if dram_key in m]
    spans = []
    if issue:
        spans.append(f"issue active {min(issue):.0f}-{max(issue):.0f}%")
    if dram:
        spans.append(f"DRAM {min(dram):.0f}-{max(dram):.0f}% of peak")
    summary = f"{found} of {len(profile['rows'])} rows profiled with {chosen}"
    return summary + (f": {', '.join(spans)}" if spans else "")


def stage_cost(ctx: Context, limit: float) -> str:
    bench = ctx.out / "bench_gpu.md"
    if not bench.is_file():
        raise Skip("needs the GPU benchmark's output (its stage did not write it)")
    status, output = ctx.run("cost", [sys.executable, "bench/gpu_cost.py", "--from", str(bench),
                                      "--out", str(ctx.out / "cost.md")], limit)
    if (ctx.out / "cost.md").is_file():
        ctx.sections["cost"] = (ctx.out / "cost.md").read_text()
    return checked(status, output, "bench/gpu_cost.py", r"of a GEMM step")


def stage_megatron(ctx: Context, limit: float) -> str:
    target = Path(tempfile.mkdtemp(prefix="sdp4bit-mcore-"))
    wheels = sorted(str(p) for p in (ctx.kit / WHEELS).glob("megatron_core-*.whl"))
    status, output = ctx.run("megatron", [sys.executable, "-m", "pip", "install", "-q",
                                          "--no-deps", "--no-index", "--no-compile", "--target",
                                          str(target), *wheels], 120)
    checked(status, output, "pip install megatron-core", r".")
    env = ctx.env(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], str(target)])
    status, output = ctx.run("megatron", [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        str(ROOT / "examples/gpt_cpu/train.py"), "--device", "cuda", "--ranks-per-node", "1",
        "--steps", "20", "--log-every", "5", "--telemetry-interval", "10",
        "--corpus-bytes", "400000"],
        max(10.0, limit - 30), env=env, cwd=Path(tempfile.gettempdir()))
    ctx.sections["megatron"] = "\n".join(
        line for line in output.splitlines()
        if re.match(r"\s*(\d+ |step|megatron-core|device|validation|bytes sent"
                    r"|sdp4bit (grad|param))", line))
    summary = checked(status, output, "megatron-core GPTModel on the GPU", r"^bytes sent")
    if "skipped steps 0; replicas bit-identical: True" not in output:
        raise Fail("a step was skipped or the replicas were not reported bit-identical")
    losses = [float(m.group(1)) for m in re.finditer(r"^\s+\d+\s+(\d+\.\d+)\s", output, re.M)]
    if len(losses) < 2 or losses[-1] >= losses[0]:
        raise Fail(f"the loss did not fall: {losses}")
    return f"loss {losses[0]:.3f} -> {losses[-1]:.3f}; {summary}"


def sanitizer(tool: str, binary: str, filters: list[str]) -> Callable[[Context, float], str]:
    def body(ctx: Context, limit: float) -> str:
        exe = shutil.which("compute-sanitizer") or next(
            (str(p) for p in sorted(Path("/usr/local").glob("cuda*/bin/compute-sanitizer"))),
            None)
        if exe is None:
            raise Skip("compute-sanitizer is not on PATH nor under /usr/local/cuda*/bin")
        status, output = ctx.run(f"sanitizer-{tool}", [
            exe, "--tool", tool, "--error-exitcode", "99", "--print-limit", "20",
            str(ctx.kit / binary), "--test-threads=1", *filters], limit,
            env=ctx.env(SDP4BIT_GPU_TEST_QUICK="1"))
        summary = last_line(output, r"ERROR SUMMARY")
        if status == 99:
            raise Fail(f"{tool}: {summary}")
        return f"{checked(status, output, tool, r'^test result: ')}; {summary}"
    return body


STAGES = [
    Stage("host", "versions: driver, GPU, torch, NCCL, NVRTC, the kit", 90, False, stage_host),
    Stage("prebuilt", "the extension built on the CPU machine loads under this Python", 60,
          False, stage_prebuilt),
    Stage("selftest", "python -m sdp4bit.selftest: every preset's kernels against the host, "
          "NCCL at W = 1", 120, True, stage_selftest),
    Stage("rust-kernels", "Rust suite: every kernel byte-equal to the CPU backend", 120, True,
          rust_tests("bin/cuda_gpu", "rust-kernels")),
    Stage("sweep", "every variant of each kernel row byte-compared with the production kernel, "
          "then timed (x copy and us); the fastest against issue 42's targets; the variant "
          "table's lines", 300, True, stage_sweep),
    Stage("bench", "every kernel against a device-to-device copy; per-bucket cost; a GEMM step "
          "beside the compression kernels", 150, True, stage_bench),
    Stage("cost", "compression kernels per bucket against a GEMM step of a GPT layer", 90, True,
          stage_cost),
    Stage("ncu", "ncu --clock-control none on each row's chosen variant: instructions per "
          "element, issue active, stall reasons, DRAM throughput", 180, True, stage_ncu),
    Stage("rust-collectives", "Rust suite: GradReduceScatter / WeightAllGather on virtual "
          "ranks byte-equal to Host", 120, True,
          rust_tests("bin/cuda_gpu_collectives", "rust-collectives")),
    Stage("memcheck", "compute-sanitizer memcheck, reduced sizes", 150, True,
          sanitizer("memcheck", "bin/cuda_gpu_collectives", [])),
    Stage("torch-cuda", "torch layer on CUDA: gloo ranks on one GPU, NCCL at W = 1, stream "
          "behaviour", 150, True, stage_torch_cuda),
    Stage("megatron", "megatron-core GPTModel trained on the GPU with the sdp4bit preset", 120,
          True, stage_megatron),
    Stage("racecheck", "compute-sanitizer racecheck, reduced sizes", 120, True,
          sanitizer("racecheck", "bin/cuda_gpu", ["grad_"])),
    Stage("synccheck", "compute-sanitizer synccheck, reduced sizes", 120, True,
          sanitizer("synccheck", "bin/cuda_gpu", ["grad_", "weight_"])),
    Stage("build", "the extension built here from the native bundle against this torch and "
          "Python", 240, False, stage_build),
]


def run_stage(ctx: Context, stage: Stage) -> Outcome:
    start = time.monotonic()
    limit = min(stage.limit, ctx.seconds_left())
    if stage.needs_gpu and not ctx.gpu:
        return Outcome(stage.name, "SKIP", 0.0, ctx.no_gpu_reason or "no GPU")
    if stage.needs_gpu and ctx.site is None:
        return Outcome(stage.name, "SKIP", 0.0, "sdp4bit is not importable (see the stages "
                                                "that install it)")
    if limit < min(30.0, stage.limit):
        return Outcome(stage.name, "SKIP", 0.0, f"out of time ({ctx.seconds_left():.0f} s "
                                                "left of the deadline)")
    try:
        summary, status = stage.body(ctx, limit), "PASS"
    except Skip as e:
        summary, status = str(e), "SKIP"
    except Fail as e:
        summary, status = str(e), "FAIL"
    except Exception as e:  # noqa: BLE001 -- a broken stage is a failure of the run, reported
        summary, status = f"{type(e).__name__}: {e}", "FAIL"
    log = ctx.logs / f"{stage.name}.log"
    tail = "\n".join(log.read_text().splitlines()[-TAIL_LINES:]) if log.is_file() else ""
    return Outcome(stage.name, status, time.monotonic() - start, summary, tail)


def report(ctx: Context, outcomes: list[Outcome], verdict: str, command: str) -> str:
    lines = ["# sdp4bit GPU kit report", ""]
    facts = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
             "command": f"`{command}`", **ctx.facts}
    lines += [f"- {label}: {value}" for label, value in facts.items()]
    lines += ["", f"**{verdict}**", "", "| stage | status | s | summary |", "|---|---|---:|---|"]
    for o in outcomes:
        lines.append(f"| {o.name} | {o.status} | {o.seconds:.0f} | "
                     f"{o.summary.replace('|', '/')} |")
    described = {s.name: s.what for s in STAGES}
    lines += ["", "Stages: " + "; ".join(f"{n}: {w}" for n, w in described.items()) + "."]
    for o in outcomes:
        if o.status == "FAIL" and o.log:
            lines += ["", f"## {o.name}: the end of its log", "", "```", o.log, "```"]
    titles = {"sweep": "Kernel variants (sweep)", "bench": "Kernel bandwidth",
              "cost": "Cost against a GEMM step", "ncu": "Nsight Compute (ncu)",
              "stream": "Stream behaviour (CUDA events)", "megatron": "megatron-core on the GPU",
              "selftest": "Selftest"}
    for key, title in titles.items():
        if ctx.sections.get(key):
            body = ctx.sections[key]
            fenced = key in ("stream", "megatron", "selftest")
            lines += ["", f"## {title}", "", *(["```", body, "```"] if fenced else [body])]
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> int:
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    logs = Path(tempfile.mkdtemp(prefix="sdp4bit-gpu-kit-logs-"))
    ctx = Context(kit=Path(args.kit).resolve(), out=out, logs=logs,
                  deadline=time.monotonic() + args.deadline)
    selected = [s for s in STAGES if not args.only or s.name in args.only.split(",")]
    outcomes: list[Outcome] = []

    def record(stage: Stage) -> Outcome:
        o = run_stage(ctx, stage)
        outcomes.append(o)
        print(f"[{o.status}] {o.name} ({o.seconds:.0f} s): {o.summary}", flush=True)
        return o

    build = next(s for s in STAGES if s.name == "build")
    background = None
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        for stage in selected:
            if stage is build:
                if background is not None:
                    outcomes.append(background.result())
                    print(f"[{outcomes[-1].status}] build (in the background, "
                          f"{outcomes[-1].seconds:.0f} s): {outcomes[-1].summary}", flush=True)
                elif not any(o.name == "build" for o in outcomes):
                    record(build)
                continue
            passed = record(stage).status == "PASS"
            if stage.name == "prebuilt" and not passed:
                # The fallback: build the extension here at once, so the GPU stages can run.
                record(build)
            elif stage.name == "prebuilt" and build in selected:
                # The proof that the host builds it too runs on the CPU beside the GPU stages.
                background = pool.submit(run_stage, ctx, build)
    failed = [o.name for o in outcomes if o.status == "FAIL"]
    passed = sum(o.status == "PASS" for o in outcomes)
    skipped = sum(o.status == "SKIP" for o in outcomes)
    verdict = f"{passed} passed, {len(failed)} failed, {skipped} skipped"
    if not ctx.gpu:
        verdict += f"; no GPU: {ctx.no_gpu_reason or 'none found'}"
    command = "bash scripts/gpu_kit.sh run " + " ".join(args.argv)
    (out / "report.md").write_text(report(ctx, outcomes, verdict, command))
    with tarfile.open(out / "logs.tar.gz", "w:gz") as tar:
        tar.add(logs, arcname="logs")
    shutil.rmtree(logs, ignore_errors=True)
    print(f"report: {out / 'report.md'}; logs: {out / 'logs.tar.gz'}\nresult: {verdict}")
    if failed:
        return EXIT_FAILED
    return EXIT_PASSED if ctx.gpu else EXIT_NO_GPU


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="scripts/gpu_kit.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    m = sub.add_parser("manifest", help="check a prepared kit and record what it is")
    m.add_argument("--kit", default=str(DEFAULT_KIT))
    m.add_argument("--max-mib", type=float, required=True)
    r = sub.add_parser("run", help="run every stage and write the report")
    r.add_argument("--out", required=True, help="folder for report.md and logs.tar.gz")
    r.add_argument("--kit", default=str(DEFAULT_KIT))
    r.add_argument("--deadline", type=float, default=400.0,
                   help="seconds the whole run may take (default 400)")
    r.add_argument("--only", default="", help="comma-separated stage names to run")
    args = parser.parse_args(argv)
    if args.command == "manifest":
        return write_manifest(Path(args.kit).resolve(), args.max_mib)
    args.argv = argv[1:]
    return run(args)


if __name__ == "__main__":
    sys.exit(main())

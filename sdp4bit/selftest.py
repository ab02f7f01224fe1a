"""The checks to run on a GPU host, and a report to paste into a bug report.

    python -m sdp4bit.selftest [--source DIR | --no-source] [--no-bench] [--timeout SECONDS]

On a host with a CUDA GPU it runs, and reports each outcome:

- the kernels of every preset against the host backend on every GPU (the kernel check a CUDA
  bucket runs at its first set-up, here for a 2x2 DP group);
- a one-process NCCL check through torch.distributed: the collectives sdp4bit uses on CUDA
  tensors, with exact expected values, a CUDA gradient bucket and weight bucket over the NCCL
  group, and the cross-group all-reduce on CUDA against the host's;
- with the source tree (``--source``, by default the checkout this package was installed
  from, or the working directory, when it holds ``Cargo.toml`` and ``tests/cuda_gpu.rs``): the
  GPU test suites (``cargo test --release --test cuda_gpu``, ``pytest tests/python/test_cuda.py``)
  and the GPU benchmark (``cargo bench --bench gpu``).

The report starts with the versions a bug report needs (Python, torch and its CUDA runtime, the
driver, NVRTC, the GPUs, sdp4bit, which compiled extension loaded and from where, and the image
its kernels loaded as). Exit status: 0 when
every check that ran passed, 1 when one failed, 2 on a host without a CUDA GPU (nothing is
checked; the report says so).
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

EXIT_PASSED = 0
EXIT_FAILED = 1
EXIT_NO_GPU = 2

_TAIL_LINES = 30  # lines of a failed command's output kept in the report


@dataclass(frozen=True)
class Outcome:
    """One check's result: ``status`` is PASS, FAIL or SKIP."""

    name: str
    status: str
    seconds: float
    detail: str = ""


def _driver_version() -> str:
    """The CUDA driver's version (``cuDriverGetVersion``), or why it is unknown."""
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        return f"unavailable ({e})"
    version = ctypes.c_int(0)
    status = libcuda.cuDriverGetVersion(ctypes.byref(version))
    if status != 0:
        return f"unavailable (cuDriverGetVersion returned {status})"
    return f"{version.value // 1000}.{version.value % 1000 // 10}"


def versions() -> list[tuple[str, str]]:
    """What a bug report needs to know about this host, as (label, value)."""
    from . import _native

    rows = [
        ("date", datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")),
        ("host", f"{platform.platform()} ({os.cpu_count()} CPUs)"),
        ("python", sys.version.split()[0]),
        ("torch", f"{torch.__version__} (CUDA runtime {torch.version.cuda or 'none'})"),
        ("CUDA driver", _driver_version()),
        ("NVRTC", _native.ops().nvrtc_report()),
        ("sdp4bit", str(Path(__file__).resolve().parent)),
        ("extension", f"{_native.extension().origin}: {_native.extension().path}"),
    ]
    if torch.cuda.is_available():
        for d in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(d)
            rows.append((f"GPU {d}", f"{p.name} (sm_{p.major}{p.minor}, "
                                     f"{p.total_memory / 2**30:.0f} GiB)"))
            rows.append((f"kernels on GPU {d}", _native.ops().cuda_device_report(d)))
    else:
        rows.append(("GPUs", "none visible to torch"))
    return rows


def format_report(rows: list[tuple[str, str]], outcomes: list[Outcome], verdict: str) -> str:
    """The text to paste into a bug report."""
    width = max(len(label) for label, _ in rows)
    lines = ["sdp4bit selftest report", ""]
    lines += [f"{label.ljust(width)}  {value}" for label, value in rows]
    lines += ["", "checks:"]
    if not outcomes:
        lines.append("  (none ran)")
    for o in outcomes:
        lines.append(f"  {o.status}  {o.name} ({o.seconds:.1f} s)")
        lines += [f"        | {line}" for line in o.detail.splitlines() if line.strip()]
    lines += ["", f"result: {verdict}"]
    return "\n".join(lines)


def run_check(name: str, check: Callable[[], str | None]) -> Outcome:
    """Runs ``check``: it returns a detail line (PASS), raises :class:`Skipped` (SKIP) or any
    other exception (FAIL, with the message)."""
    start = time.monotonic()
    try:
        detail = check() or ""
        status = "PASS"
    except Skipped as e:
        detail, status = str(e), "SKIP"
    except Exception as e:  # noqa: BLE001 -- every failure becomes a line of the report
        detail, status = f"{type(e).__name__}: {e}", "FAIL"
    return Outcome(name, status, time.monotonic() - start, detail)


class Skipped(Exception):
    """A check that cannot run here, and why."""


def _command(args: list[str], cwd: Path, env: dict[str, str], timeout: float) -> str:
    """Runs ``args``; returns the last line of its output, raises with its tail on failure."""
    done = subprocess.run(args, cwd=cwd, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=timeout, check=False)
    tail = "\n".join(done.stdout.splitlines()[-_TAIL_LINES:])
    if done.returncode != 0:
        raise RuntimeError(f"`{' '.join(args)}` exited with {done.returncode}:\n{tail}")
    return tail


def find_source(given: str | None) -> Path | None:
    """The source tree: ``given``, else the checkout this package lives in, else the working
    directory; None when none holds Cargo.toml and tests/cuda_gpu.rs."""
    candidates = [Path(given)] if given else [Path(__file__).resolve().parent.parent, Path.cwd()]
    for root in candidates:
        if (root / "Cargo.toml").is_file() and (root / "tests" / "cuda_gpu.rs").is_file():
            return root.resolve()
    return None


def _source_env(source: Path) -> dict[str, str]:
    """The environment of the source tree's commands: the test command's NVRTC on
    LD_LIBRARY_PATH (else the torch wheels' through ``SDP4BIT_NVRTC_DIRS``, which importing
    sdp4bit set) and a GPU required."""
    env = dict(os.environ, SDP4BIT_REQUIRE_GPU="1", SDP4BIT_REQUIRE_NVRTC="1")
    dirs = sorted(source.glob(".cache/nvrtc-*/nvidia/*/lib"))
    if dirs:
        env["LD_LIBRARY_PATH"] = os.pathsep.join(
            [str(d) for d in dirs] + [p for p in [env.get("LD_LIBRARY_PATH")] if p])
    return env


def check_kernels(device: int) -> str:
    """Every preset's kernels on ``device`` against the host (rank 1 of a 2x2 DP group)."""
    from . import _native
    from .config import presets

    ops = _native.ops()
    for preset in presets():
        ops.cuda_kernel_check(device, preset, [0, 0, 1, 1], 1)
    return f"presets {', '.join(presets())}: the device's bytes equal the host's"


def check_nccl() -> str:
    """A one-process NCCL group: all-to-all, all-gather, reduce-scatter, MAX all-reduce with
    exact values, then a CUDA gradient bucket and weight bucket over it."""
    import torch.distributed as dist

    import sdp4bit

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("nccl", init_method=f"file://{tmp}/store", rank=0, world_size=1,
                                device_id=device)
        try:
            x = torch.arange(1024, dtype=torch.float32, device=device)
            out = torch.empty_like(x)
            dist.all_to_all_single(out, x)
            gathered = torch.empty_like(x)
            dist.all_gather_into_tensor(gathered, x)
            reduced = torch.empty_like(x)
            dist.reduce_scatter_tensor(reduced, x)
            peak = x.max().clone()
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
            for name, got in [("all_to_all_single", out), ("all_gather_into_tensor", gathered),
                              ("reduce_scatter_tensor", reduced)]:
                if not torch.equal(got, x):
                    raise RuntimeError(f"NCCL {name} at W = 1 changed its input")
            if peak.item() != 1023.0:
                raise RuntimeError(f"NCCL MAX all-reduce gave {peak.item()}, expected 1023")
            groups = sdp4bit.ProcessGroups.create(dist.group.WORLD, node_labels=[0])
            grads = torch.randn(4096, device=device)
            shard = torch.empty(4096, device=device)
            rs = sdp4bit.GradReduceScatter(groups, sdp4bit.Config("sdp4bit"), grads.numel(),
                                           bucket_id=0, device=device)
            rs.start(grads, shard, 1).wait()
            if not torch.equal(shard, grads):
                raise RuntimeError("a W = 1 CUDA gradient bucket did not copy its input")
            params = torch.randn(4096, device=device).to(torch.bfloat16)
            before = params.clone()
            ag = sdp4bit.WeightAllGather(groups, sdp4bit.Config("sdp4bit"), params, bucket_id=1)
            ag.start(params, 1).wait()
            torch.cuda.synchronize(device)
            if not torch.equal(params, before):
                raise RuntimeError("a W = 1 CUDA weight bucket changed its params")
            _check_cross_group(groups, device)
            groups.close()
        finally:
            dist.destroy_process_group()
    return ("NCCL collectives exact at W = 1; CUDA gradient and weight buckets over NCCL; the "
            "CUDA cross-group all-reduce equal to the host's")


def _check_cross_group(groups, device: torch.device) -> None:
    """The Global-QSGD all-reduce across groups (numerics §7.6) of a one-rank group on CUDA
    over NCCL (its device passes, int8 sums) against the host's over gloo, same streams: the
    bits must be equal."""
    import torch.distributed as dist

    import sdp4bit

    config = sdp4bit.Config("sdp4bit")
    data = torch.randn(4096) * torch.logspace(-3, 1, 4096)
    on_device = data.to(device)
    sdp4bit.CrossGroupAllReduce(groups, config, data.numel(), 2, 0, device).start(
        on_device, 1).wait()
    host_groups = sdp4bit.ProcessGroups.create(dist.new_group([0], backend="gloo"),
                                               node_labels=[0])
    try:
        sdp4bit.CrossGroupAllReduce(host_groups, config, data.numel(), 2, 0).start(data, 1).wait()
    finally:
        host_groups.close()
    torch.cuda.synchronize(device)
    if not torch.equal(on_device.cpu().view(torch.int32), data.view(torch.int32)):
        raise RuntimeError("the CUDA cross-group all-reduce differs from the host's")


def run(args: argparse.Namespace) -> int:
    rows = versions()
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        verdict = ("no CUDA GPU is visible to torch on this host: nothing was checked "
                   "(run this on a GPU host)")
        print(format_report(rows, [], verdict))
        return EXIT_NO_GPU
    outcomes = [run_check(f"kernels against the host on GPU {d}", lambda d=d: check_kernels(d))
                for d in range(torch.cuda.device_count())]
    outcomes.append(run_check("one-process NCCL through torch.distributed", check_nccl))
    source = None if args.no_source else find_source(args.source)

    def in_source(command: list[str]) -> Callable[[], str]:
        def check() -> str:
            if args.no_source:
                raise Skipped("--no-source")
            if source is None:
                raise Skipped("needs the source tree (--source DIR with Cargo.toml and "
                              "tests/cuda_gpu.rs)")
            return _command(command, source, _source_env(source), args.timeout)
        return check

    outcomes.append(run_check("cargo test --release --test cuda_gpu", in_source(
        ["cargo", "test", "--locked", "--release", "--test", "cuda_gpu"])))
    pytest_check = in_source(
        [sys.executable, "-m", "pytest", "-q", "-rs", "tests/python/test_cuda.py"])

    def with_pytest() -> str:
        try:
            import pytest  # noqa: F401 -- only whether it is installed
        except ImportError as e:
            raise Skipped("pytest is not installed in this environment "
                          "(pip install -r requirements-test.txt)") from e
        return pytest_check()

    outcomes.append(run_check("pytest tests/python/test_cuda.py", with_pytest))
    if args.no_bench:
        outcomes.append(Outcome("cargo bench --bench gpu", "SKIP", 0.0, "--no-bench"))
    else:
        outcomes.append(run_check("cargo bench --bench gpu", in_source(
            ["cargo", "bench", "--locked", "--bench", "gpu"])))
    failed = [o for o in outcomes if o.status == "FAIL"]
    passed = sum(o.status == "PASS" for o in outcomes)
    skipped = sum(o.status == "SKIP" for o in outcomes)
    verdict = f"{passed} passed, {len(failed)} failed, {skipped} skipped"
    print(format_report(rows, outcomes, verdict))
    return EXIT_FAILED if failed else EXIT_PASSED


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sdp4bit.selftest", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", help="the sdp4bit source tree (default: found)")
    parser.add_argument("--no-source", action="store_true",
                        help="only the package's own checks (kernels, NCCL): none that needs "
                             "the source tree and cargo")
    parser.add_argument("--no-bench", action="store_true", help="skip the GPU benchmark")
    parser.add_argument("--timeout", type=float, default=3600.0,
                        help="seconds each command may run (default 3600)")
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

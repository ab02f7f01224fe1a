"""What compression costs on a GPU: one rank's compression kernels per bucket (the GPU
benchmark's per-bucket cost, `bench/gpu.rs`) against a bf16 GEMM step of a GPT layer with the
same parameter count, measured in the same run on the same GPU.

    python bench/gpu_cost.py [--from BENCH_OUTPUT] [--tokens N] [--out FILE]

Without --from it runs `cargo bench --bench gpu` with SDP4BIT_BENCH_SECTIONS=cost,concurrent
itself. A layer of P parameters has hidden size h with 12 h^2 = P (rounded to a multiple of
64); its GEMM step is the forward and backward products of its four linear layers (QKV, attention
output, MLP up and down: 12 products, 6 T P floating-point operations for T tokens) on one
micro-batch of T tokens (default 8192, e.g. 4 sequences of 2048), each timed with CUDA events
as the median of repeated runs. Attention's own products and everything else a step does are
left out, so the fraction is an upper bound for one micro-batch; with k micro-batches per
optimizer step it divides by k, since a bucket is compressed once per step.

It then prints issue 42's targets (item 6) met or missed: each bucket's whole sequence within
`TARGETS.sequence` (sdp4bit/kernel_times.py) of the time its bytes take at the benchmark's
copy bandwidth, and compression at most 10% of the GEMM step of one micro-batch; and the GEMM
step's slowdown beside the compression kernels (the benchmark's `concurrent` section), which
is reported without a target.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COST_PREFIX = "cost-json: "
CONCURRENT_PREFIX = "concurrent-json: "
#: Issue 42's target (item 6): one rank's compression kernels per bucket at most this fraction
#: of a GEMM step of one micro-batch.
GEMM_FRACTION_TARGET = 0.10


def parse_costs(text: str) -> dict:
    """The per-bucket cost the GPU benchmark printed (its `cost-json:` line)."""
    lines = [line for line in text.splitlines() if line.startswith(COST_PREFIX)]
    if not lines:
        raise ValueError("the benchmark output has no cost-json line (did its cost section run?)")
    return json.loads(lines[-1][len(COST_PREFIX):])


def parse_concurrent(text: str) -> dict | None:
    """The benchmark's GEMM beside the compression kernels (its `concurrent-json:` line), or
    None where its section did not run."""
    lines = [line for line in text.splitlines() if line.startswith(CONCURRENT_PREFIX)]
    return json.loads(lines[-1][len(CONCURRENT_PREFIX):]) if lines else None


def sequence_target() -> float:
    """Issue 42's target for the per-bucket sequence, as sdp4bit/kernel_times.py writes it
    (loaded by path: the package itself needs its extension)."""
    spec = importlib.util.spec_from_file_location("sdp4bit_kernel_times",
                                                  ROOT / "sdp4bit" / "kernel_times.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module.TARGETS.sequence


def verdict(met: bool) -> str:
    return "met" if met else "**missed**"


def target_lines(costs: dict, fractions: list[float], tokens: int,
                 concurrent: dict | None) -> list[str]:
    """Issue 42's targets met or missed, one line each, and the GEMM's slowdown beside the
    compression kernels."""
    lines = ["Targets (issue 42, item 6):"]
    target = sequence_target()
    copy = costs.get("copy_gbps")
    for row in costs["rows"]:
        what = f"{row['numel'] >> 20} Mi, {row['grad']} gradients"
        ms = row["reduce_scatter_ms"] + row["all_gather_ms"]
        if copy is None or row.get("bytes") is None:
            lines.append(f"- sequence within {target}x of its bytes at copy speed ({what}): not "
                         "known (this benchmark output has no bytes or copy bandwidth)")
            continue
        at_copy = row["bytes"] / (copy * 1e9) * 1e3
        lines.append(f"- sequence within {target}x of its bytes at copy speed ({what}): "
                     f"{ms:.3f} ms against {at_copy:.3f} ms for {row['bytes'] / 2**20:.1f} MiB at "
                     f"{copy:.1f} GB/s, {ms / at_copy:.2f}x: {verdict(ms / at_copy <= target)}")
    for row, fraction in zip(costs["rows"], fractions):
        lines.append(f"- compression at most {GEMM_FRACTION_TARGET:.0%} of a GEMM step of "
                     f"{tokens} tokens ({row['numel'] >> 20} Mi, {row['grad']} gradients): "
                     f"{fraction:.1%}: {verdict(fraction <= GEMM_FRACTION_TARGET)}")
    rows = (concurrent or {}).get("rows") or []
    if rows:
        for r in rows:
            slowdown = r["gemm_beside_ms"] / r["gemm_ms"] - 1
            lines.append(f"- GEMM step beside the compression kernels on the side stream "
                         f"({concurrent['numel'] >> 20} Mi, {r['grad']} gradients, hidden "
                         f"{concurrent['hidden']}, {concurrent['tokens']} tokens): "
                         f"{r['gemm_ms']:.3f} ms alone, {r['gemm_beside_ms']:.3f} ms beside, "
                         f"slowdown {slowdown:+.1%} (reported; compression "
                         f"{r['compression_ms']:.3f} ms alone, "
                         f"{r['compression_beside_ms']:.3f} ms beside)")
    else:
        why = (concurrent or {}).get("skipped") or "its section did not run"
        lines.append(f"- GEMM step beside the compression kernels: not measured ({why})")
    return lines


def layer_hidden(params: int) -> int:
    """The hidden size of a GPT layer of about `params` parameters (12 h^2), a multiple of 64."""
    return max(64, round(math.sqrt(params / 12) / 64) * 64)


def layer_shapes(hidden: int) -> list[tuple[int, int]]:
    """(in, out) of the layer's four linear layers."""
    return [(hidden, 3 * hidden), (hidden, hidden), (hidden, 4 * hidden), (4 * hidden, hidden)]


def gemm_step_ms(hidden: int, tokens: int, repeats: int = 20) -> float:
    """Median milliseconds of the layer's forward and backward GEMMs on one micro-batch."""
    import torch

    device = torch.device("cuda")
    operands = []
    for fan_in, fan_out in layer_shapes(hidden):
        x = torch.randn(tokens, fan_in, device=device, dtype=torch.bfloat16)
        w = torch.randn(fan_out, fan_in, device=device, dtype=torch.bfloat16)
        dy = torch.randn(tokens, fan_out, device=device, dtype=torch.bfloat16)
        operands.append((x, w, dy))

    def step() -> None:
        for x, w, dy in operands:
            torch.matmul(x, w.t())  # forward
            torch.matmul(dy, w)  # input gradient
            torch.matmul(dy.t(), x)  # weight gradient

    for _ in range(3):
        step()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def table(costs: dict, tokens: int, gemm: dict[int, float]) -> tuple[list[str], list[float]]:
    """The markdown rows and the fractions, one per cost row."""
    rows = ["| bucket elements | gradients | GPT layer (hidden, params) | GEMM step ms | TFLOP/s "
            "| compression ms (RS + AG) | fraction of the GEMM step | target |",
            "|---:|---|---|---:|---:|---:|---:|---|"]
    fractions = []
    for row in costs["rows"]:
        hidden = layer_hidden(row["numel"])
        params = sum(i * o for i, o in layer_shapes(hidden))
        ms = gemm[hidden]
        tflops = 6 * tokens * params / (ms * 1e-3) / 1e12
        compression = row["reduce_scatter_ms"] + row["all_gather_ms"]
        fractions.append(compression / ms)
        rows.append(f"| {row['numel'] >> 20} Mi | {row['grad']} | {hidden}, {params / 1e6:.1f} M "
                    f"| {ms:.3f} | {tflops:.0f} | {row['reduce_scatter_ms']:.3f} + "
                    f"{row['all_gather_ms']:.3f} | {100 * compression / ms:.1f}% | "
                    f"{verdict(compression / ms <= GEMM_FRACTION_TARGET)} |")
    return rows, fractions


def bench_output() -> str:
    """The GPU benchmark's cost section, run now."""
    env = dict(os.environ, SDP4BIT_BENCH_SECTIONS="cost,concurrent", SDP4BIT_REQUIRE_GPU="1")
    done = subprocess.run(["cargo", "bench", "--locked", "--bench", "gpu"], cwd=ROOT, env=env,
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        sys.exit(f"the GPU benchmark failed ({done.returncode}):\n{done.stdout}{done.stderr}")
    return done.stdout


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--from", dest="source", help="the GPU benchmark's output to read")
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per micro-batch")
    parser.add_argument("--out", help="also write the markdown here")
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("skipped: torch sees no CUDA GPU")
        return 0
    output = Path(args.source).read_text() if args.source else bench_output()
    costs = parse_costs(output)
    gemm = {h: gemm_step_ms(h, args.tokens)
            for h in sorted({layer_hidden(r["numel"]) for r in costs["rows"]})}
    rows, fractions = table(costs, args.tokens, gemm)
    command = "python bench/gpu_cost.py" + (f" --from {args.source}" if args.source else "")
    text = "\n".join([
        "# Compression kernels against a GEMM step", "",
        f"- device: {torch.cuda.get_device_name()} (kernels timed on {costs['device']})",
        f"- date: {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}",
        f"- command: `{command}`; torch {torch.__version__}",
        f"- one rank's compression kernels per step (preset {costs['preset']}, W = 4 as "
        f"{costs['world']}, exchanges excluded) against the bf16 forward and backward GEMMs of "
        f"a GPT layer's linear layers on {args.tokens} tokens", "", *rows, "",
        *target_lines(costs, fractions, args.tokens, parse_concurrent(output)), "",
        f"compression kernels: {100 * min(fractions):.1f}% to {100 * max(fractions):.1f}% of a "
        f"GEMM step of a GPT layer of the same parameter count ({args.tokens} tokens)"])
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

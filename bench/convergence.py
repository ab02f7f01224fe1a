"""Convergence study: the paper's ablation at small scale (docs/numerics.md §10).

Trains the byte-level GPT of examples/gpt_cpu with W = 4 ranks as 2 nodes x 2 ranks on CPU,
once per row, with the same seed and data order: baseline, qW, qWD, TLq, TLq-HS, SDP4Bit,
QSDP, Global-QSGD, ZeRO++-style, plus the baseline with another data seed as a measure of
run-to-run noise. Writes a table of final validation loss (held-out 10% of the standard
library's sources) and a PNG of the training-loss curves.

    bash scripts/bench.sh convergence --steps 1200 --out bench/results     # the study
    bash scripts/bench.sh convergence --steps 3 --rows baseline,qWD,SDP4Bit --out /tmp/smoke
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
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TRAIN = ROOT / "examples" / "gpt_cpu" / "train.py"

#: name -> (preset, knobs, extra train.py arguments)
ROWS = {
    "baseline": ("baseline", [], []),
    "qW": ("sdp4bit", ["weight_codec=qw", "grad_codec=none"], []),
    "qWD": ("sdp4bit", ["weight_codec=qwd", "grad_codec=none"], []),
    "TLq": ("sdp4bit", ["weight_codec=none", "grad_codec=tlq"], []),
    "TLq-HS": ("sdp4bit", ["weight_codec=none", "grad_codec=tlq-hs"], []),
    "SDP4Bit": ("sdp4bit", [], []),
    "QSDP": ("qsdp", [], []),
    "Global-QSGD": ("global-qsgd", [], []),
    "ZeRO++": ("zeropp", [], []),
    "baseline (data seed 2)": ("baseline", [], ["--seed", "4321"]),
}


def run_row(name: str, steps: int, scratch: Path, extra: list[str]) -> dict:
    preset, knobs, row_args = ROWS[name]
    result = scratch / f"row-{''.join(c if c.isalnum() else '_' for c in name)}.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "4", str(TRAIN), "--ranks-per-node", "2",
               "--preset", preset, "--steps", str(steps), "--log-every", str(max(steps // 4, 1)),
               "--telemetry-interval", "0", "--json-out", str(result), *row_args, *extra]
    for knob in knobs:
        command += ["--knob", knob]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    start = time.monotonic()
    done = subprocess.run(command, env=env, cwd=scratch, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"row {name} failed (exit {done.returncode}):\n{done.stdout}\n{done.stderr[-3000:]}")
    data = json.loads(result.read_text())
    data["seconds"] = time.monotonic() - start
    print(f"{name:>22}: validation loss {data['val_loss']:.4f}, "
          f"{data['seconds']:.0f} s", flush=True)
    return data


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def smooth(values: list[float], window: int) -> list[float]:
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def plot(results: dict[str, dict], path: Path, steps: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5.5))
    window = max(steps // 40, 1)
    for name, data in results.items():
        style = ":" if "seed" in name else "-"
        ax.plot(smooth(data["train_loss"], window), style, label=f"{name} ({data['val_loss']:.3f})",
                linewidth=1.2)
    ax.set_xlabel("step")
    ax.set_ylabel(f"training loss (mean over ranks, moving average of {window})")
    ax.set_title("byte-level GPT, W = 4 (2 nodes x 2 ranks), CPU: final validation loss in ()")
    ax.set_ylim(top=min(4.0, ax.get_ylim()[1]))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=1200)
    p.add_argument("--rows", default=",".join(ROWS), help="comma-separated row names")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("train_args", nargs="*", help="extra train.py arguments (after --)")
    args = p.parse_args()
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = [r.strip() for r in args.rows.split(",")]
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        sys.exit(f"unknown rows {unknown}; known: {', '.join(ROWS)}")
    started = datetime.datetime.now(datetime.timezone.utc)
    with tempfile.TemporaryDirectory() as scratch:
        results = {name: run_row(name, args.steps, Path(scratch), args.train_args) for name in rows}
    base = results.get("baseline", {}).get("val_loss")
    noise = None
    if "baseline (data seed 2)" in results and base is not None:
        noise = abs(results["baseline (data seed 2)"]["val_loss"] - base)
    command = f"python bench/convergence.py --steps {args.steps} --out {os.path.relpath(args.out, ROOT)}"
    if rows != list(ROWS):
        command += f" --rows {args.rows}"
    lines = [
        "# Convergence study (small-scale ablation)",
        "",
        f"- machine: {os.cpu_count()} cores, {cpu_model()}, Python {platform.python_version()}",
        f"- date: {started:%Y-%m-%d %H:%M} UTC",
        f"- command: `{command}`",
        "- model: byte-level GPT (examples/gpt_cpu, 0.44 M params, context 64), AdamW lr 3e-3, "
        "8 sequences per rank per step, W = 4 gloo ranks as 2 nodes x 2 ranks, megatron-core "
        "0.16.1 DDP, same seed and data order for every row except the last",
        "",
        "| row | final validation loss | vs baseline | bytes sent / uncompressed | time |",
        "|---|---|---|---|---|",
    ]
    for name, data in results.items():
        delta = f"{data['val_loss'] - base:+.4f}" if base is not None else "-"
        ratio = f"{data['sent'] / data['uncompressed']:.3f}" if data["uncompressed"] else "1 (not intercepted)"
        lines.append(f"| {name} | {data['val_loss']:.4f} | {delta} | {ratio} | {data['seconds']:.0f} s |")
    if noise is not None:
        lines += ["", f"Run-to-run noise (baseline with another data seed): {noise:.4f}."]
    (args.out / "convergence.md").write_text("\n".join(lines) + "\n")
    (args.out / "convergence.json").write_text(json.dumps(results))
    plot(results, args.out / "convergence.png", args.steps)
    print("\n".join(lines))


if __name__ == "__main__":
    main()

"""The Hadamard transform of TLq-HS on real gradients: where it lowers the quantization error,
and why (docs/numerics.md §3).

    SDP4BIT_TEST_OPS=1 bash scripts/bench.sh hadamard_real --out bench/results  # ~6 min, 2 cores

Trains the convergence study's SDP4Bit row (examples/gpt_cpu/train.py, W = 4 as 2 nodes x 2,
the study's schedule, once per seed of --seeds) and saves every rank's gradient buckets before any
reduction at --dump-steps (train.py --dump-grads, which leaves the run bit-identical). Then,
for each dumped step, the same four ranks' buckets go through the core's in-process two-level
reduce-scatter (the test build's ``simulate_grad_reduce_scatter``, the code of the distributed
one) with TLq (no Hadamard) and TLq-HS, over --draws independent rounding draws each (the
collective's step picks its Philox streams), against the exact sum in fp64. Reported per step:

- the relative L2 error of the reduced buckets, each codec's mean with its 95% interval over
  the draws, and their ratio;
- per quantization group (the codec's group size of consecutive elements of the reduced
  bucket): the error's mean square over the draws relative to the group's, its median and
  99th percentile, and the share of groups where TLq-HS's is lower;
- what the quantizer sees: each group of rank 0's gradient, its peak over its RMS (the scale
  of a symmetric group is its peak; the error grows with peak/RMS) and its excess kurtosis,
  raw and after the block Hadamard, median and 99th percentile over groups.

Those in full for the first seed; then, per step, each seed's error ratio (TLq-HS / TLq) and
their mean with its 95% interval over the seeds, the step's effect as a tested one.

The same on the same tensors with synthetic outlier channels (two fixed positions of every
group, as a channel of a weight gradient recurs once per row, times --outlier-scale on every
rank): where outliers exist the transform spreads them over the block; where the groups are
already flat it has nothing to spread. Writes hadamard_real.md and hadamard_real.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

if __name__ == "__main__":
    # The rank launcher forks the training run's ranks from this process, which must then have
    # one thread: torch's OpenMP pool is made single-threaded before torch loads.
    os.environ["OMP_NUM_THREADS"] = "1"

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

from convergence import ROWS, WORLD, common_args, study_launcher  # noqa: E402
from convergence_stats import interval  # noqa: E402

LABELS = [0, 0, 1, 1]  # W = 4 as 2 nodes x 2, as the study runs
CODECS = ("tlq", "tlq-hs")
OUTLIER_POSITIONS = (3, 67)  # in every group of 128


def codec_config(codec: str, seed: int = 1):
    """The SDP4Bit row's gradient codec `codec`, weights uncompressed (the study's TLq rows),
    rounding seed `seed`. sdp4bit is imported here, after the training runs: loading it starts
    a thread, and the rank launcher forks only a single-threaded process."""
    from sdp4bit import Config

    return Config.from_knobs("sdp4bit", {"weight_codec": "none", "grad_codec": codec,
                                         "seed": str(seed)})


def knob(config, name: str) -> int:
    """The resolved integer value of knob `name` (the preset's default when not overridden)."""
    return int(dict(config.resolved.values)[name])


def hadamard_blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """`x` (length a multiple of `block`) times the orthonormal Hadamard matrix of size `block`
    (Sylvester's order; any order gives each block the same set of values), block by block."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < block:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    return (x.double().reshape(-1, block) @ h / math.sqrt(block)).reshape(-1)


def group_shape(x: torch.Tensor, group: int) -> dict[str, float]:
    """Peak over RMS and excess kurtosis of every non-zero group of `group` consecutive values
    of `x`: their medians and 99th percentiles."""
    groups = x.double().reshape(-1, group)
    square = groups.square().mean(1)
    groups, square = groups[square > 0], square[square > 0]
    crest = groups.abs().amax(1) / square.sqrt()
    kurtosis = groups.pow(4).mean(1) / square.square() - 3
    q = torch.tensor([0.5, 0.99], dtype=torch.float64)
    c, k = torch.quantile(crest, q), torch.quantile(kurtosis, q)
    return {"crest_median": c[0].item(), "crest_p99": c[1].item(),
            "kurtosis_median": k[0].item(), "kurtosis_p99": k[1].item()}


def with_outlier_channels(inputs: torch.Tensor, scale: float) -> torch.Tensor:
    """`inputs` with OUTLIER_POSITIONS of every group of 128 (of every rank) times `scale`."""
    out = inputs.clone()
    for position in OUTLIER_POSITIONS:
        out[:, position::128] *= scale
    return out


def reduce_errors(inputs: torch.Tensor, bucket_id: int, draws: int,
                  seed: int = 1) -> dict[str, dict]:
    """For each codec: the relative L2 error of every draw, and each group's mean square error
    over the draws relative to the group's mean square (groups of the codec's size; all-zero
    groups left out)."""
    exact = inputs.double().sum(0)
    out = {}
    for codec in CODECS:
        config = codec_config(codec, seed)
        group = knob(config, "grad_group_size")
        squared = torch.zeros_like(exact)
        rel = []
        for draw in range(draws):
            shards = torch.ops.sdp4bit.simulate_grad_reduce_scatter(
                config.spec(), LABELS, bucket_id, draw, inputs)
            error = shards.reshape(-1).double() - exact
            rel.append((error.norm() / exact.norm()).item())
            squared += error.square()
        per_group = (squared / draws).reshape(-1, group).mean(1)
        reference = exact.square().reshape(-1, group).mean(1)
        keep = reference > 0
        out[codec] = {"rel_l2": rel, "group_nmse": (per_group[keep] / reference[keep])}
    return out


def summarize(errors_by_bucket: list[dict], shapes: list[dict], numels: list[int]) -> dict:
    """One step's figures over its buckets: the element-weighted relative error per draw (its
    mean and interval), the group error quantiles, the share of groups where TLq-HS is lower,
    and the groups' shape (raw and after the Hadamard, weighted by bucket)."""
    total = sum(numels)
    row: dict = {}
    for codec in CODECS:
        draws = len(errors_by_bucket[0][codec]["rel_l2"])
        per_draw = [math.sqrt(sum(e[codec]["rel_l2"][d] ** 2 * n
                                  for e, n in zip(errors_by_bucket, numels)) / total)
                    for d in range(draws)]
        ci = interval(per_draw)
        nmse = torch.cat([e[codec]["group_nmse"] for e in errors_by_bucket])
        q = torch.quantile(nmse, torch.tensor([0.5, 0.99], dtype=torch.float64))
        row[codec] = {"rel_l2": ci.mean, "rel_l2_half_width": ci.half_width,
                      "group_nmse_median": q[0].item(), "group_nmse_p99": q[1].item()}
    lower = torch.cat([e["tlq-hs"]["group_nmse"] < e["tlq"]["group_nmse"]
                       for e in errors_by_bucket])
    row["hs_lower_share"] = lower.double().mean().item()
    row["ratio"] = row["tlq-hs"]["rel_l2"] / row["tlq"]["rel_l2"]
    for kind in ("raw", "hadamard"):
        row[kind] = {k: sum(s[kind][k] * n for s, n in zip(shapes, numels)) / total
                     for k in shapes[0][kind]}
    return row


def analyse(dumps: Path, steps: list[int], draws: int, outlier_scale: float,
            seed: int) -> dict:
    """Every step dumped by seed `seed`'s run, as is and with outlier channels: step ->
    variant -> figures."""
    config = codec_config("tlq-hs")
    block, group = knob(config, "hadamard_block"), knob(config, "grad_group_size")
    results: dict = {}
    for step in steps:
        ranks = [torch.load(dumps / f"step{step}-rank{r}.pt") for r in range(WORLD)]
        for variant in ("as trained", "outlier channels"):
            errors, shapes, numels = [], [], []
            for bucket_id, per_rank in enumerate(zip(*ranks)):
                inputs = torch.stack(per_rank).float()
                if variant == "outlier channels":
                    inputs = with_outlier_channels(inputs, outlier_scale)
                errors.append(reduce_errors(inputs, bucket_id, draws, seed))
                shapes.append({"raw": group_shape(inputs[0], group),
                               "hadamard": group_shape(hadamard_blocks(inputs[0], block), group)})
                numels.append(inputs.shape[1])
            results.setdefault(str(step), {})[variant] = summarize(errors, shapes, numels)
    return results


def dump_gradients(launcher, dumps: Path, seed: int, steps: int, dump_steps: list[int],
                   val_tokens: int) -> None:
    """The SDP4Bit row's run at `seed` with its gradients dumped at `dump_steps`."""
    row = ROWS["SDP4Bit"]
    args = [*row.script_args(seed, steps, common_args(steps, val_tokens), dumps / "run.json"),
            "--dump-grads", str(dumps), "--dump-steps", ",".join(map(str, dump_steps))]
    done = launcher.run(row.script, args, WORLD, dumps, 1800)
    if done.returncode != 0:
        sys.exit(f"train.py failed (exit {done.returncode}):\n{done.output[-4000:]}")


def report(args: argparse.Namespace, by_seed: dict, started: str) -> str:
    first = str(args.seeds[0])
    results = by_seed[first]
    lines = [
        "# The Hadamard transform on real gradients",
        "",
        f"Produced by `python bench/hadamard_real.py --steps {args.steps} --dump-steps "
        f"{','.join(map(str, args.dump_steps))} --draws {args.draws} --seeds "
        f"{','.join(map(str, args.seeds))}` on {started} "
        f"({platform.processor() or platform.machine()}, {torch.__version__}); what it does: "
        "the docstring of [bench/hadamard_real.py](../hadamard_real.py).",
        "",
        f"Gradients of the study's SDP4Bit row, seed {first}, W = 4 as 2 x 2, dumped before any "
        "reduction; each step's four buckets reduced by the core with TLq and TLq-HS over "
        f"{args.draws} rounding draws. Relative L2 error: mean ± 95% interval over the draws. "
        "Group figures: groups of the codec's size; NMSE = mean square error over the draws / "
        "the group's mean square. Shape: rank 0's groups, raw and after the block Hadamard.",
        "",
        "| step | data | TLq rel. error | TLq-HS rel. error | HS / no H | groups where HS is "
        "lower | group NMSE median TLq / HS | group NMSE p99 TLq / HS | peak/RMS median, p99: "
        "raw → H | excess kurtosis median, p99: raw → H |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for step, variants in results.items():
        for variant, r in variants.items():
            t, h = r["tlq"], r["tlq-hs"]
            raw, had = r["raw"], r["hadamard"]
            lines.append(
                f"| {step} | {variant} | {t['rel_l2']:.4f} ± {t['rel_l2_half_width']:.4f} | "
                f"{h['rel_l2']:.4f} ± {h['rel_l2_half_width']:.4f} | {r['ratio']:.3f} | "
                f"{100 * r['hs_lower_share']:.1f}% | {t['group_nmse_median']:.2e} / "
                f"{h['group_nmse_median']:.2e} | {t['group_nmse_p99']:.2e} / "
                f"{h['group_nmse_p99']:.2e} | {raw['crest_median']:.2f}, {raw['crest_p99']:.2f} "
                f"→ {had['crest_median']:.2f}, {had['crest_p99']:.2f} | "
                f"{raw['kurtosis_median']:.2f}, {raw['kurtosis_p99']:.2f} → "
                f"{had['kurtosis_median']:.2f}, {had['kurtosis_p99']:.2f} |")
    seeds = [str(seed) for seed in args.seeds]
    lines += [
        "",
        f"Over seeds {', '.join(seeds)} (each its own run, rounding seed and draws): TLq-HS's "
        "error / TLq's per seed, and their mean with its 95% interval over the seeds.",
        "",
        "| step | data | per seed | mean ± 95% interval |",
        "|---:|---|---|---:|",
    ]
    for step, variants in results.items():
        for variant in variants:
            ratios = [by_seed[seed][step][variant]["ratio"] for seed in seeds]
            ci = interval(ratios)
            spread = "-" if ci.n < 2 else f"{ci.mean:.3f} ± {ci.half_width:.3f}"
            lines.append(f"| {step} | {variant} | {', '.join(f'{r:.3f}' for r in ratios)} | "
                         f"{spread} |")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, default=400, help="the run's length (the study's)")
    p.add_argument("--dump-steps", default="0,50,150,399")
    p.add_argument("--draws", type=int, default=32, help="rounding draws per codec and step")
    p.add_argument("--outlier-scale", type=float, default=20.0)
    p.add_argument("--val-tokens", type=int, default=4096)
    p.add_argument("--seeds", default="1,2,3", help="the runs' seeds, comma-separated")
    args = p.parse_args(argv)
    args.dump_steps = [int(s) for s in args.dump_steps.split(",")]
    args.seeds = [int(s) for s in args.seeds.split(",")]
    if any(not 0 <= s < args.steps for s in args.dump_steps) or args.draws < 2:
        p.error("--dump-steps must lie in [0, --steps) and --draws be at least 2")
    return args


def require_test_build() -> None:
    """Exits with what to run unless the installed sdp4bit is the test build (its in-process
    reference collectives, cargo feature test-ops); checked in a child process, since loading
    sdp4bit here would start a thread before the launcher forks."""
    probe = "import sdp4bit, torch; torch.ops.sdp4bit.simulate_grad_reduce_scatter"
    found = subprocess.run([sys.executable, "-c", probe], capture_output=True,
                           cwd=tempfile.gettempdir())  # not the source tree's sdp4bit/
    if found.returncode != 0:
        sys.exit("bench/hadamard_real.py needs sdp4bit's test build (the in-process reference "
                 "collectives): SDP4BIT_TEST_OPS=1 bash scripts/bench.sh hadamard_real ...")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    require_test_build()
    started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    launcher = study_launcher()
    with tempfile.TemporaryDirectory() as scratch:
        for seed in args.seeds:  # every run before sdp4bit loads (codec_config)
            (Path(scratch) / str(seed)).mkdir()
            dump_gradients(launcher, Path(scratch) / str(seed), seed, args.steps,
                           args.dump_steps, args.val_tokens)
        results = {str(seed): analyse(Path(scratch) / str(seed), args.dump_steps, args.draws,
                                      args.outlier_scale, seed) for seed in args.seeds}
    args.out.mkdir(parents=True, exist_ok=True)
    text = report(args, results, started)
    (args.out / "hadamard_real.md").write_text(text)
    (args.out / "hadamard_real.json").write_text(json.dumps(results, indent=1))
    print(text)


if __name__ == "__main__":
    main()

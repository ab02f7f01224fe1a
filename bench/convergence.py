"""Convergence study: the paper's ablation at small scale (docs/numerics.md §10).

Trains megatron-core's GPTModel with its real DistributedOptimizer (examples/gpt_cpu/train.py)
on W = 4 gloo ranks as 2 nodes x 2 ranks on CPU (forked by megatron_on_cpu/rank_launcher.py, which
imports the libraries once for all runs), once per row and seed: baseline, qW, qWD,
TLq, TLq-HS, SDP4Bit, QSDP, Global-QSGD, ZeRO++-style; the same model at TP = 2 x DP = 2
(train.py --tp 2), with Megatron's own collectives (baseline TP=2) and the sdp4bit preset
(SDP4Bit TP=2); and a byte-level GPT under PyTorch FSDP2 (examples/fsdp2/train.py,
sdp4bit.fsdp) with FSDP's own numerics (FSDP2) and with QSDP's weight and gradient codecs
(FSDP2 QSDP). Every row runs the seeds of --seeds, and the rows
that decide the study's precision target, SDP4Bit and its baseline, run more
(--deciding-seeds). A seed fixes the initial weights, the data order (each rank's batches
drawn from a hash of the seed and the rank, ``--data-seeding hashed``, so no two seeds share a
rank's stream; the committed study ran with ``offset`` seeding, seed + 1000 + rank, under
which adjacent seeds share 3 of their 4 ranks' streams) and sdp4bit's random
streams, so each row's difference from its reference row (a baseline trained by the same
script and layout: baseline, baseline TP=2 or FSDP2) is taken seed by seed
(paired), over the row's own seeds. Writes, to --out: convergence.md
(each row's mean final validation loss over held-out tokens, its paired difference from its
reference with a 95% interval, the relative error of the gradient reduce-scatter and of the
weight all-gather from sdp4bit's telemetry, bytes sent), convergence.json (every run) and
convergence.png (loss curves and paired differences with their intervals).

    bash scripts/bench.sh convergence --out bench/results        # the full study (~72 min)
    bash scripts/bench.sh convergence --steps 3 --seeds 1,2 --rows baseline,SDP4Bit \\
        --val-tokens 8192 --out /tmp/smoke                        # the test command's smoke run

Rows are :class:`Row` entries of ROWS: a training script and its arguments. Any script that
takes ``--seed``, ``--steps``, ``--json-out`` and the common arguments below, and writes the
same JSON as examples/gpt_cpu/train.py (``train_loss``, ``val_loss``, ``step_ms``, ``sent``,
``uncompressed``, ``grad_rel_l2``, ``param_rel_l2``), can be a row; its ``reference`` names the
row it is differenced against, which must run the same script (the same model), or is its own
name for a reference row.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import hashlib
import json
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "megatron_on_cpu"))
sys.path.insert(0, str(ROOT / "examples" / "gpt_cpu"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from convergence_stats import (interval, paired_difference, seeds_for_width,  # noqa: E402
                               upper_bound)
from rank_launcher import RankLauncher  # noqa: E402  (megatron_on_cpu, put on the path above)

TRAIN = ROOT / "examples" / "gpt_cpu" / "train.py"
FSDP_TRAIN = ROOT / "examples" / "fsdp2" / "train.py"
BASELINE = "baseline"
TP_BASELINE = "baseline TP=2"
HYBRID_BASELINE = "baseline hybrid"
FSDP_BASELINE = "FSDP2"
#: Ranks of every run (2 nodes x 2), and the longest a run may take before it is stopped.
WORLD = 4
RANKS_PER_NODE = 2
RUN_TIMEOUT_SECONDS = 1800


@dataclass(frozen=True)
class Row:
    """One configuration of the study: `script` run with `args` (its collectives), differenced
    seed by seed against the row named `reference`, a row of the same script; a row whose
    reference is itself is a reference row (its difference is zero)."""

    name: str
    args: tuple[str, ...]
    script: Path = TRAIN
    reference: str = BASELINE
    #: Set: sdp4bit's rounding streams are seeded from a hash of (seed, this salt) instead of
    #: the run's seed (``--knob seed=``), all else equal: the null control's one change.
    rounding_salt: str | None = None

    @property
    def is_reference(self) -> bool:
        """Whether this row is a reference (the baseline of its script's rows)."""
        return self.reference == self.name

    def run_args(self, seed: int) -> tuple[str, ...]:
        """The row's own arguments for the run of `seed`."""
        if self.rounding_salt is None:
            return self.args
        return (*self.args, "--knob", f"seed={salted_seed(seed, self.rounding_salt)}")

    def script_args(self, seed: int, steps: int, common: list[str],
                    json_out: Path) -> list[str]:
        """The arguments of `script` for one run (on WORLD ranks as 2 nodes)."""
        return ["--ranks-per-node", str(RANKS_PER_NODE), *self.run_args(seed), "--seed",
                str(seed), "--steps", str(steps), "--json-out", str(json_out), *common]


def salted_seed(seed: int, salt: str) -> int:
    """A 64-bit seed from a hash of (`seed`, `salt`), independent of the seed itself."""
    digest = hashlib.blake2b(f"{seed}/{salt}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def preset_args(name: str, *knobs: str) -> tuple[str, ...]:
    """train.py's arguments for the preset `name` with `knobs` (NAME=VALUE) set."""
    args = ("--preset", name)
    for knob in knobs:
        args += ("--knob", knob)
    return args


#: The TP = 2 rows' layout and batch (train.py's arguments).
TP2 = ("--tp", "2", "--batch", "16")
#: The hybrid rows' layout: 2 distributed-optimizer instances, one per node.
HYBRID = ("--instances", "2")

ROWS = {row.name: row for row in (
    # Megatron's own collectives, through the integration's uncompressed path.
    Row(BASELINE, preset_args("baseline")),
    Row("qW", preset_args("sdp4bit", "weight_codec=qw", "grad_codec=none")),
    Row("qWD", preset_args("sdp4bit", "weight_codec=qwd", "grad_codec=none")),
    Row("TLq", preset_args("sdp4bit", "weight_codec=none", "grad_codec=tlq")),
    Row("TLq-HS", preset_args("sdp4bit", "weight_codec=none", "grad_codec=tlq-hs")),
    Row("SDP4Bit", preset_args("sdp4bit")),
    Row("QSDP", preset_args("qsdp")),
    Row("Global-QSGD", preset_args("global-qsgd")),
    Row("ZeRO++-style", preset_args("zeropp")),
    # TP = 2 x DP = 2: Megatron's TP groups are consecutive ranks, so each node is a TP pair
    # and each DP group ({0, 2}, {1, 3}) has one rank per node: sdp4bit's gradient
    # reduce-scatter has one level, 4-bit between nodes. Parameters replicated across the TP
    # pair travel exact (exact_params=replicated). 16 sequences per DP rank: the 32 per step
    # of the rows above. Another layout of the model, so differenced against its own baseline.
    Row(TP_BASELINE, (*preset_args("baseline"), *TP2), reference=TP_BASELINE),
    Row("SDP4Bit TP=2", (*preset_args("sdp4bit"), *TP2), reference=TP_BASELINE),
    # Hybrid sharding: 2 distributed-optimizer instances, each one node of 2 ranks (sdp4bit's
    # reduce-scatter and all-gather inside the node), the gradient shards all-reduced across
    # the nodes: Megatron's own fp32 all-reduce, or Global-QSGD's 8-bit integers
    # (cross_group_bits=8, numerics §7.6). Differenced against Megatron's own partial
    # distributed optimizer.
    Row(HYBRID_BASELINE, (*preset_args("baseline"), *HYBRID), reference=HYBRID_BASELINE),
    Row("SDP4Bit hybrid", (*preset_args("sdp4bit"), *HYBRID), reference=HYBRID_BASELINE),
    # A different model (FSDP2's byte-level GPT), so differenced against its own baseline:
    # FSDP's own numerics through sdp4bit.fsdp's uncompressed path, then QSDP's codecs.
    Row(FSDP_BASELINE, preset_args("baseline"), FSDP_TRAIN, reference=FSDP_BASELINE),
    Row("FSDP2 QSDP", preset_args("qsdp"), FSDP_TRAIN, reference=FSDP_BASELINE),
    # sdp4bit.fsdp's default: QSDP's 8-bit weights (FSDP keeps no previous weights for qWD)
    # and TLq-HS gradients.
    Row("FSDP2 SDP4Bit", preset_args("sdp4bit"), FSDP_TRAIN, reference=FSDP_BASELINE),
)}


def select_rows(names: list[str], table: dict[str, Row] | None = None) -> list[Row]:
    """The rows `names` of `table` (default ROWS), in that order; raises ValueError for an
    unknown or repeated name, a row whose reference is not among `names`, or a reference of
    another script. A reference may itself be differenced against another row (the null
    control against SDP4Bit), as long as the chain ends at a reference row."""
    table = ROWS if table is None else table
    unknown = [n for n in names if n not in table]
    if unknown:
        raise ValueError(f"unknown rows {unknown}: rows are among {', '.join(table)}")
    if len(set(names)) != len(names):
        raise ValueError(f"rows repeat: {names}")
    rows = [table[n] for n in names]
    for row in rows:
        if row.reference not in names:
            raise ValueError(f"row {row.name!r} is differenced against {row.reference!r}: "
                             f"add {row.reference!r} to --rows")
        ref = table[row.reference]
        if ref.script != row.script:
            raise ValueError(f"row {row.name!r}: its reference {ref.name!r} must be a row of "
                             f"the same script ({shown_path(row.script)})")
        chain = [row.name]
        while not table[chain[-1]].is_reference:
            chain.append(table[chain[-1]].reference)
            if chain[-1] in chain[:-1]:
                raise ValueError(f"rows reference each other in a circle: "
                                 f"{' -> '.join(chain)}")
    return rows

#: The full study's size. Precision: SDP4Bit's paired differences from the baseline have a
#: standard deviation of about 0.0094 (20 seeds; 0.0075 over the first 5), and a 95% interval's
#: full width is 2 t(0.975, n - 1) / sqrt(n) times that, so a full width under 0.5% of the loss
#: (0.0093) needs about 19 seeds: SDP4Bit and its baseline (DECIDING_ROWS) run 20 seeds
#: (DECIDING_SEEDS), every other row the study's minimum of 3 (SEEDS). Time: 400 steps; per
#: row, the training and evaluation time of the fastest of its kept runs (bench/results/
#: convergence.json; the machine was shared during most of them, so these are upper bounds)
#: plus the launch of a run by megatron_on_cpu/rank_launcher.py (2.4 s a Megatron run, 5 s an
#: FSDP2 run, measured on the shared machine): baseline 56 s, SDP4Bit 68 s, the other 7
#: Megatron rows 427 s together, the 3 FSDP2 rows 270 s together (FSDP2 SDP4Bit counted as
#: FSDP2 QSDP's 90 s), the 2 TP = 2 rows 98 s together (their fastest kept runs, launch
#: included, on the shared machine), and the 2 hybrid rows 106 s together (49 s and 52 s, their
#: fastest runs in bench/results/hybrid/, plus two launches). 20 x (56 + 68) + 3 x (427 + 270 +
#: 98 + 106) = 5183 s, 87 minutes, inside the 90 the study may take. Timed end to
#: end on the idle 2-core machine (2026-11-24, bench/results/convergence_default_timed.md),
#: the default study took 55.7 minutes, 50 s a run, before the TP = 2 rows were added (6 runs
#: more). Launched by torchrun, every run paid 12-24 s more, for the imports of torch and
#: megatron-core on every rank.
#: The committed study ran the other rows on 5 seeds (`--seeds 1,2,3,4,5`), for narrower
#: intervals there; its 85 runs took 147 minutes on the shared machine. Its TP = 2 rows ran
#: later, on 10 seeds (bench/results/convergence.md); the hybrid rows apart, on 5 seeds
#: (bench/results/hybrid/).
STEPS = 400
ESTIMATED_MINUTES = 87
SEEDS = "1,2,3"
#: The rows whose paired difference the study's precision target is about (SDP4Bit's interval
#: narrower than 0.5% of the baseline's loss), and the seeds they run when --seeds is left at
#: its default.
DECIDING_ROWS = (BASELINE, "SDP4Bit")
DECIDING_SEEDS = ",".join(str(s) for s in range(1, 21))
VAL_TOKENS = 1_048_576
#: Bytes of the training text (the standard library's sources, examples/gpt_cpu/data.py).
CORPUS_BYTES = 5_000_000
COMMON = ["--data-seeding", "hashed", "--lr", "3e-3", "--lr-decay", "cosine",
          "--warmup-steps", "{warmup}",
          "--min-lr", "3e-4", "--corpus-bytes", str(CORPUS_BYTES), "--val-tokens", "{val_tokens}",
          "--telemetry-interval", "{telemetry}", "--log-every", "1000000"]


def study_launcher() -> RankLauncher:
    """The launcher the study's runs (and the programs rerunning them) fork their ranks from:
    one OpenMP thread per rank, library warnings off."""
    return RankLauncher({"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"})


def common_args(steps: int, val_tokens: int) -> list[str]:
    values = {"warmup": max(steps // 12, 0), "val_tokens": val_tokens,
              "telemetry": max(steps // 10, 1)}
    return [arg.format(**values) for arg in COMMON]


def run_file(row: Row, seed: int, runs_dir: Path) -> Path:
    """Where the run of `row` and `seed` is kept in `runs_dir`."""
    safe = "".join(c if c.isalnum() else "_" for c in row.name)
    return runs_dir / f"{safe}-seed{seed}.json"


def ran_with_args(row: Row, seed: int, steps: int, common: list[str]) -> list[str]:
    """What a kept run records it ran with: the script, then its arguments but the layout's
    and the output's (a kept run is reused only where these are equal)."""
    return [shown_path(row.script), *row.run_args(seed), "--seed", str(seed), "--steps",
            str(steps), *common]


@functools.cache
def training_text_digest() -> str:
    """A digest of the training text this interpreter gives the runs: the standard library's
    sources, which differ between Python builds (3.11.2 and 3.11.7 train on different bytes)."""
    import torch

    from data import stdlib_corpus  # examples/gpt_cpu, put on the path above

    text = stdlib_corpus(CORPUS_BYTES).to(torch.uint8).numpy().tobytes()
    return hashlib.blake2b(text, digest_size=16).hexdigest()


def kept_run(row: Row, seed: int, steps: int, common: list[str], runs_dir: Path) -> dict | None:
    """The run of `row` and `seed` kept in `runs_dir` with these arguments and this
    interpreter's training text, or None."""
    result = run_file(row, seed, runs_dir)
    if not result.exists():
        return None
    data = json.loads(result.read_text())
    same = (data.get("ran_with") == ran_with_args(row, seed, steps, common)
            and data.get("training_text") == training_text_digest())
    return data if same else None


def run(row: Row, seed: int, steps: int, common: list[str], runs_dir: Path,
        launcher: RankLauncher) -> dict:
    """One training run, its ranks forked by `launcher`; its JSON, with the wall time it took
    and the arguments it ran with. A result already in `runs_dir` from the same script and
    arguments is reused (so a study that stopped part way resumes where it stopped); any other
    is run again."""
    result, ran_with = run_file(row, seed, runs_dir), ran_with_args(row, seed, steps, common)
    data = kept_run(row, seed, steps, common, runs_dir)
    if data is not None:
        print(f"{row.name:>13} seed {seed}: validation loss {data['val_loss']:.4f} "
              f"(reused from {result})", flush=True)
        return data
    start = time.monotonic()
    done = launcher.run(row.script, row.script_args(seed, steps, common, result), WORLD,
                        runs_dir, RUN_TIMEOUT_SECONDS)
    if done.returncode != 0:
        sys.exit(f"{row.name} seed {seed} failed (exit {done.returncode}):\n"
                 f"{done.output[-6000:]}")
    data = json.loads(result.read_text())
    data["seconds"] = time.monotonic() - start
    data["ran_with"] = ran_with
    data["training_text"] = training_text_digest()
    result.write_text(json.dumps(data))
    print(f"{row.name:>13} seed {seed}: validation loss {data['val_loss']:.4f}, "
          f"{data['seconds']:.0f} s", flush=True)
    return data


def row_seeds(rows: list[Row], seeds: list[int], deciding: list[int]) -> dict[str, list[int]]:
    """The seeds each row runs: `deciding` for the rows of DECIDING_ROWS, `seeds` for the
    others. Raises ValueError unless `deciding` holds every seed of `seeds` (so every row's
    reference has the row's seeds and the pairing is complete)."""
    missing = sorted(set(seeds) - set(deciding))
    if missing:
        raise ValueError(f"--deciding-seeds lacks seeds {missing} of --seeds: the rows "
                         f"{', '.join(DECIDING_ROWS)} run every seed the other rows run")
    return {row.name: list(deciding if row.name in DECIDING_ROWS else seeds) for row in rows}


def run_study(rows: list[Row], seeds: dict[str, list[int]], steps: int, common: list[str],
              runs_dir: Path, launcher: RankLauncher) -> dict[str, dict[int, dict]]:
    """Every row for each of its seeds (`seeds`: row name -> seeds), seed after seed (so a
    study cut short has whole seeds): row name -> seed -> the run's JSON."""
    runs: dict[str, dict[int, dict]] = {row.name: {} for row in rows}
    for seed in sorted({s for of_row in seeds.values() for s in of_row}):
        for row in rows:
            if seed in seeds[row.name]:
                runs[row.name][seed] = run(row, seed, steps, common, runs_dir, launcher)
    return runs


def smooth(values: list[float], window: int) -> list[float]:
    """Trailing moving average over `window` steps."""
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def summarize(rows: list[Row], runs: dict[str, dict[int, dict]]) -> dict[str, dict]:
    """Per row: validation loss over seeds, paired difference from its reference row (absolute
    and relative to the reference's mean), telemetry errors, bytes."""
    summary = {}
    for row in rows:
        name, by_seed = row.name, runs[row.name]
        base = {seed: r["val_loss"] for seed, r in runs[row.reference].items()}
        base_mean = statistics.fmean(base.values())
        losses = {seed: r["val_loss"] for seed, r in by_seed.items()}
        diff = paired_difference(losses, base)
        deltas = [losses[seed] - base[seed] for seed in losses]
        first = next(iter(by_seed.values()))
        summary[name] = {
            "reference": row.reference,
            "seeds": len(by_seed),
            "val_loss": asdict(interval(list(losses.values()))),
            "difference": asdict(diff),
            "difference_spread": statistics.stdev(deltas) if len(deltas) > 1 else None,
            "relative_difference": {"mean": diff.mean / base_mean,
                                    "half_width": diff.half_width / base_mean},
            "grad_rel_l2": mean([e for r in by_seed.values() for e in r["grad_rel_l2"]]),
            "param_rel_l2": mean([e for r in by_seed.values() for e in r["param_rel_l2"]]),
            "bytes_ratio": first["sent"] / first["uncompressed"] if first["uncompressed"] else None,
            "median_step_ms": statistics.median(
                ms for r in by_seed.values() for ms in r["step_ms"][min(5, len(r["step_ms"]) - 1):]),
            "mean_run_seconds": statistics.fmean(r["seconds"] for r in by_seed.values()),
        }
    return summary


#: The non-inferiority margin, stated before the rows are read: a row is shown no worse than its
#: reference where the one-sided 95% upper bound of its paired difference is under this fraction
#: of the reference's loss (the paper's gaps are +0.09% to +0.24% of the loss).
MARGIN = 0.0025


def relative_differences(row: Row, runs: dict[str, dict[int, dict]]) -> tuple[list[float], float]:
    """The row's paired differences of final validation loss, seed by seed, as fractions of its
    reference's mean over the row's seeds; and that mean."""
    mine, base = runs[row.name], runs[row.reference]
    reference_mean = statistics.fmean(base[seed]["val_loss"] for seed in mine)
    return ([(mine[seed]["val_loss"] - base[seed]["val_loss"]) / reference_mean
             for seed in sorted(mine)], reference_mean)


def non_inferiority(rows: list[Row], runs: dict) -> list[str]:
    """The non-inferiority table: per compressed row, its paired difference from its reference
    (each as a fraction of the reference's mean loss over the row's own seeds), the one-sided
    95% upper bound of that difference, and whether the bound is under :data:`MARGIN`."""
    lines = [f"| row | seeds | reference (same seeds) | difference | one-sided 95% upper bound | "
             f"under +{100 * MARGIN:.2f}%? |",
             "|---|---:|---|---:|---:|---|"]
    for row in rows:
        if row.is_reference:
            continue
        deltas, base_mean = relative_differences(row, runs)
        bound = upper_bound(deltas)
        lines.append(f"| {row.name} | {len(deltas)} | {row.reference} ({base_mean:.4f}) | "
                     f"{100 * statistics.fmean(deltas):+.2f}% | {100 * bound:+.2f}% | "
                     f"{'yes' if bound < MARGIN else 'no'} |")
    return lines


def difference_curves(rows: list[Row], runs: dict[str, dict[int, dict]],
                      window: int) -> dict[str, list]:
    """Per row and step: the paired difference of the smoothed training loss from its
    reference row's, as (mean, half-width of the 95% interval) over seeds."""
    curves = {}
    for row in rows:
        base = {seed: smooth(r["train_loss"], window) for seed, r in runs[row.reference].items()}
        mine = {seed: smooth(r["train_loss"], window) for seed, r in runs[row.name].items()}
        steps = len(next(iter(mine.values())))
        curves[row.name] = [paired_difference({s: mine[s][i] for s in mine},
                                              {s: base[s][i] for s in mine})
                            for i in range(steps)]
    return curves


def plot(rows: list[Row], runs: dict[str, dict[int, dict]], path: Path, steps: int) -> None:
    """Loss curves (every row over the seeds all rows ran) and each row's paired difference
    from its reference along training, with its 95% interval."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    window = max(steps // 30, 1)
    fig, (curves_ax, diff_ax) = plt.subplots(1, 2, figsize=(14, 5.5))
    differences = difference_curves(rows, runs, window)
    # The curves average every row over the same seeds (rows may run more), so they compare.
    common = sorted(set.intersection(*(set(runs[row.name]) for row in rows)))
    for row in rows:
        name, by_seed = row.name, runs[row.name]
        smoothed = [smooth(by_seed[seed]["train_loss"], window) for seed in common]
        average = [sum(v) / len(v) for v in zip(*smoothed)]
        final = statistics.fmean(by_seed[seed]["val_loss"] for seed in common)
        label = f"{name} ({final:.4f})"
        line, = curves_ax.plot(average, label=label, linewidth=1.1)
        if row.is_reference:
            continue
        diff = differences[name]
        centre = [d.mean for d in diff]
        diff_ax.plot(centre, color=line.get_color(), linewidth=1.1,
                     label=f"{name} - {row.reference}")
        if len(by_seed) > 1:
            diff_ax.fill_between(range(len(diff)), [d.low for d in diff], [d.high for d in diff],
                                 color=line.get_color(), alpha=0.15)
    curves_ax.set_xlabel("step")
    curves_ax.set_ylabel(f"training loss (mean over ranks and seeds, moving average of {window})")
    curves_ax.set_title(f"W = 4 (2 x 2) on CPU, seeds {seed_text(','.join(map(str, common)))} "
                        "of every row;\ntheir mean final validation loss in ()", fontsize=10)
    curves_ax.set_ylim(top=min(4.0, curves_ax.get_ylim()[1]))
    diff_ax.axhline(0.0, color="black", linewidth=0.8)
    settled = [d for row in rows if not row.is_reference
               for d in differences[row.name][len(differences[row.name]) // 2:]]
    if settled:  # the early, large swings would hide the end, which the table is about
        bounds = [b for d in settled for b in (d.low, d.high) if b == b] or [0.0]
        margin = 0.1 * (max(bounds) - min(bounds) or 1.0)
        diff_ax.set_ylim(min(bounds) - margin, max(bounds) + margin)
    diff_ax.set_xlabel("step")
    diff_ax.set_ylabel("paired difference from the reference row (smoothed training loss)")
    diff_ax.set_title("row - reference row (same script), seed by seed: mean and 95% interval",
                      fontsize=10)
    for ax in (curves_ax, diff_ax):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def error_text(value: float | None) -> str:
    return "-" if value is None else f"{value:.2e}"


def shown_path(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def report(args, rows: list[Row], runs: dict, summary: dict[str, dict],
           started: datetime.datetime, elapsed: float) -> str:
    import megatron.core

    full = "bash scripts/bench.sh convergence --out bench/results"
    shown = (f"bash scripts/bench.sh convergence --steps {args.steps} --seeds {args.seeds} "
             f"--deciding-seeds {args.deciding_seeds} --val-tokens {args.val_tokens} "
             f"--rows {shlex.quote(','.join(r.name for r in rows))} "
             f"--out {shown_path(args.out)}")
    run_count = sum(s["seeds"] for s in summary.values())
    per_run = sum(s["mean_run_seconds"] * s["seeds"] for s in summary.values()) / run_count
    models = []
    megatron_references = [row.name for row in rows if row.is_reference and row.script == TRAIN]
    if megatron_references:
        models.append(
            f"- model (rows against {' and '.join(megatron_references)}): megatron-core GPTModel "
            "(byte-level, 0.44 M params, context 64, width 128, 2 layers, local layer spec), "
            "DDP + DistributedOptimizer (torch Adam, bf16 params, fp32 main params and "
            "gradients, clip 1.0)")
    if TP_BASELINE in megatron_references:
        models.append(
            f"- layout (rows against {TP_BASELINE}): TP = 2 x DP = 2 (train.py --tp 2), each "
            "node a TP pair, the DP groups {0, 2} and {1, 3} one rank per node (sdp4bit's "
            "gradient reduce-scatter: one level, 4-bit between nodes); parameters replicated "
            "across the TP pair travel exact (exact_params=replicated); 16 sequences per DP rank")
    if HYBRID_BASELINE in megatron_references:
        models.append(
            f"- layout (rows against {HYBRID_BASELINE}): 2 distributed-optimizer instances "
            "(train.py --instances 2), each one node of 2 ranks; the gradient shards "
            "all-reduced across the instances, SDP4Bit hybrid with Global-QSGD's 8-bit "
            "integers (cross_group_bits=8)")
    if any(row.script == FSDP_TRAIN for row in rows):
        models.append(
            f"- model (rows against {FSDP_BASELINE}): examples/fsdp2/train.py's byte-level GPT "
            "(0.44 M params, context 64, width 128, 2 torch TransformerEncoderLayer blocks, tied "
            "head) under FSDP2's fully_shard per block (bf16 params, fp32 gradient reduction), "
            "torch AdamW, clip 1.0, through sdp4bit.fsdp (docs/fsdp.md)")
    lines = [
        "# Convergence study (small-scale ablation)",
        "",
        f"- the full study: `{full}` (defaults: {STEPS} steps, seeds {seed_text(SEEDS)} "
        f"for every row and {seed_text(DECIDING_SEEDS)} for {' and '.join(DECIDING_ROWS)}, "
        f"{VAL_TOKENS:,d} held-out tokens; about {ESTIMATED_MINUTES} min on 2 cores, sized in "
        "bench/convergence.py)",
        f"- this run: `{shown}`",
        f"- machine: {os.cpu_count()} cores, {cpu_model()}, Python {platform.python_version()}, "
        f"megatron-core {megatron.core.__version__}",
        f"- date: {started:%Y-%m-%d %H:%M} UTC; the {run_count} runs took "
        f"{per_run * run_count / 60:.1f} min ({per_run:.0f} s each on average; "
        f"this invocation {elapsed / 60:.1f} min, less where it reused kept runs)",
        *models,
        "- training: lr 3e-3 with warm-up and cosine decay to 3e-4, 32 sequences per step (8 "
        "per DP rank at DP = 4), W = 4 gloo ranks as 2 nodes x 2 ranks",
        f"- validation: the last {args.val_tokens:,d} bytes of the corpus (held out), every "
        "token predicted once; each row's difference is from its reference row (a baseline "
        "trained by the same script, named in the table), paired by seed (same initial "
        "weights, data order and random streams); intervals are 95% Student t over the seeds",
        "- errors: relative L2 error of each collective against the framework's exact one "
        "(Megatron's, FSDP's), from sdp4bit's telemetry (mean over its reports); '-' where "
        "nothing is compressed",
        "",
        "| row | seeds | final validation loss | reference | difference from reference | "
        "relative | grad RS rel. error | weight AG rel. error | bytes sent / uncompressed | step |",
        "|---|---:|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        s = summary[row.name]
        val = s["val_loss"]
        diff = s["difference"]
        rel = s["relative_difference"]
        own = "1 (Megatron's)" if row.script == TRAIN else "1 (FSDP's)"
        ratio = f"{s['bytes_ratio']:.3f}" if s["bytes_ratio"] is not None else own
        several = s["seeds"] > 1
        val_text = (f"{val['mean']:.4f} ± {val['half_width']:.4f}"
                    if several else f"{val['mean']:.4f}")
        diff_text = (f"{diff['mean']:+.4f} ± {diff['half_width']:.4f}"
                     if several else f"{diff['mean']:+.4f}")
        rel_text = (f"{100 * rel['mean']:+.2f}% ± {100 * rel['half_width']:.2f}%"
                    if several else f"{100 * rel['mean']:+.2f}%")
        lines.append(f"| {row.name} | {s['seeds']} | {val_text} | {row.reference} | "
                     f"{diff_text} | {rel_text} | "
                     f"{error_text(s['grad_rel_l2'])} | {error_text(s['param_rel_l2'])} | "
                     f"{ratio} | "
                     f"{s['median_step_ms']:.0f} ms |")
    lines += ["", f"Non-inferiority at a margin of +{100 * MARGIN:.2f}% of the loss, fixed "
                  "before the rows were read (a row is shown no worse than its reference only "
                  "where the bound is under it; a 'no' is no finding either way):", "",
              *non_inferiority(rows, runs)]
    if "SDP4Bit" in summary and summary["SDP4Bit"]["seeds"] > 1:
        half = summary["SDP4Bit"]["difference"]["half_width"]
        base = summary[summary["SDP4Bit"]["reference"]]["val_loss"]["mean"]
        verdict = {True: "under", False: "NOT under"}
        lines += ["", f"SDP4Bit's interval is ±{half:.4f}, ±{100 * half / base:.2f}% of the "
                      f"baseline's loss ({base:.4f}): half-width {verdict[half < 0.005 * base]} "
                      f"0.5%, full width ({200 * half / base:.2f}%) "
                      f"{verdict[2 * half < 0.005 * base]} 0.5%."]
        spread = summary["SDP4Bit"]["difference_spread"]
        needed = seeds_for_width(spread, 0.005 * base)
        pair_seconds = (summary["SDP4Bit"]["mean_run_seconds"]
                        + summary[summary["SDP4Bit"]["reference"]]["mean_run_seconds"])
        lines += [f"At the spread of its paired differences measured here (standard deviation "
                  f"{spread:.4f}), a full width under 0.5% needs {needed} seeds (this run has "
                  f"{summary['SDP4Bit']['seeds']}), about {needed * pair_seconds / 60:.0f} min "
                  f"of SDP4Bit and baseline runs at this run's times."]
    return "\n".join(lines) + "\n"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=STEPS)
    p.add_argument("--seeds", default=SEEDS, help="comma-separated seeds, shared by all rows")
    p.add_argument("--deciding-seeds",
                   help=f"comma-separated seeds of the rows {', '.join(DECIDING_ROWS)}, a "
                        f"superset of --seeds (default: {DECIDING_SEEDS} when --seeds is its "
                        "default, else --seeds)")
    add_study_arguments(p, ROWS)
    return p.parse_args()


def add_study_arguments(p: argparse.ArgumentParser, rows: dict[str, Row]) -> None:
    """The arguments a study shares with the others: --rows (of `rows`), --val-tokens, --out,
    --runs-dir."""
    p.add_argument("--rows", default=",".join(rows),
                   help="comma-separated row names, each row's reference row among them")
    p.add_argument("--val-tokens", type=int, default=VAL_TOKENS)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--runs-dir", type=Path,
                   help="keep each run's JSON here and reuse those of the same arguments "
                        "(resumes a study that stopped); default: a temporary directory")


def seed_text(text: str) -> str:
    """Comma-separated seeds as written, or `first-last` when they run consecutively."""
    seeds = [int(s) for s in text.split(",")]
    consecutive = seeds == list(range(seeds[0], seeds[0] + len(seeds)))
    return f"{seeds[0]}-{seeds[-1]}" if consecutive and len(seeds) > 2 else text


def seed_list(text: str) -> list[int]:
    seeds = [int(s) for s in text.split(",")]
    if len(set(seeds)) != len(seeds):
        sys.exit(f"seeds repeat: {seeds}")
    return seeds


def main() -> None:
    args = parse_args()
    args.out = args.out.resolve()
    names = [r.strip() for r in args.rows.split(",")]
    try:
        rows = select_rows(names)
    except ValueError as e:
        sys.exit(f"--rows: {e}")
    if args.deciding_seeds is None:
        args.deciding_seeds = DECIDING_SEEDS if args.seeds == SEEDS else args.seeds
    seeds, deciding = seed_list(args.seeds), seed_list(args.deciding_seeds)
    try:
        seeds_by_row = row_seeds(rows, seeds, deciding)
    except ValueError as e:
        sys.exit(str(e))
    args.out.mkdir(parents=True, exist_ok=True)
    started = datetime.datetime.now(datetime.timezone.utc)
    clock = time.monotonic()
    common = common_args(args.steps, args.val_tokens)
    with tempfile.TemporaryDirectory() as scratch:
        runs_dir = args.runs_dir.resolve() if args.runs_dir else Path(scratch)
        runs_dir.mkdir(parents=True, exist_ok=True)
        launcher = study_launcher()
        runs = run_study(rows, seeds_by_row, args.steps, common, runs_dir, launcher)
    summary = summarize(rows, runs)
    text = report(args, rows, runs, summary, started, time.monotonic() - clock)
    (args.out / "convergence.md").write_text(text)
    (args.out / "convergence.json").write_text(json.dumps({"summary": summary, "runs": runs}))
    plot(rows, runs, args.out / "convergence.png", args.steps)
    print(text)


if __name__ == "__main__":
    main()

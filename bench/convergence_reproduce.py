"""Reruns the start of kept convergence-study runs on the current tree and checks that every
training loss is the kept run's, bit for bit: the study describes the tree only while the
tree still computes what the study ran.

    python bench/convergence_reproduce.py --kept bench/results/convergence.json --steps 15

Pairs of rows at seed 1: by default baseline TP=2 / SDP4Bit TP=2, the pair kept last (on an
Intel Xeon, with the training script as it is now); ``--pairs "baseline,SDP4Bit"`` adds the
TP = 1 pair, kept on an AMD EPYC on 2026-11-24 by the scripts of then (its codecs' numerics
are checked on any machine by tests/python/test_codec_digest.py). ``--kept
bench/results/long/convergence_long.json --pairs baseline,SDP4Bit`` checks the long study's
pair (bench/convergence_long.py), kept under Debian's Python 3.11.2, the interpreter of CI's
fresh machine. A pair is first probed:
the reference row's first step alone, whose loss comes before any collective, optimizer step
or sdp4bit code: it depends only on the initial weights, the data (the training text is the
interpreter's standard library, so its Python build matters) and the floating-point kernels
of the CPU and the torch build. When that loss differs from the kept one, this environment is
not the one the pair was kept in (the study names its machines and Python), and the pair is
reported as not comparable here, not as a failure: CI's fresh machine, whose Python is
Debian's 3.11.2, is such an environment for every kept pair (kept under Python 3.11.7). Otherwise both rows are rerun for --steps steps, each with
the arguments its kept run recorded, and every loss must be the kept one; a difference names
the row and the first step that differs. Exit status 1 on any difference, and with --require
also when no pair was comparable; 0 otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from convergence import RANKS_PER_NODE, ROOT, WORLD, study_launcher  # noqa: E402

#: (reference row, compressed row) pairs checked by default.
PAIRS = (("baseline TP=2", "SDP4Bit TP=2"),)
SEED = "1"
RUN_TIMEOUT_SECONDS = 600


@dataclass(frozen=True)
class Verdict:
    """One pair's outcome: `comparable` is False when the probe's loss differed; `problems`
    lists each row whose rerun differs from its kept run."""

    pair: tuple[str, str]
    comparable: bool
    problems: tuple[str, ...]
    note: str


def kept_arguments(kept_run: dict) -> tuple[Path, list[str]]:
    """The script and arguments the kept run ran with (its `ran_with`: the script's path from
    the repository root, then its arguments, without the rank layout and the JSON output; a
    run kept before ``--data-seeding`` existed was seeded "offset")."""
    ran_with = kept_run["ran_with"]
    args = list(ran_with[1:])
    if "--data-seeding" not in args:  # kept before the flag: the seeding of then
        args += ["--data-seeding", "offset"]
    return ROOT / ran_with[0], args


def first_difference(got: list[float], want: list[float]) -> str | None:
    """Where the rerun's losses `got` first differ from the kept `want` (compared bit for bit,
    as Python floats; the rerun may be shorter), or None when every step agrees."""
    if len(got) > len(want):
        return f"the rerun has {len(got)} steps, the kept run {len(want)}"
    for step, (a, b) in enumerate(zip(got, want)):
        if a.hex() != b.hex():
            return f"step {step}: loss {a!r} against the kept {b!r}"
    return None


def rerun(launcher, kept_run: dict, steps: int, work: Path) -> list[float]:
    """The first `steps` training losses of the kept run's arguments, rerun now."""
    script, args = kept_arguments(kept_run)
    out = work / "run.json"
    out.unlink(missing_ok=True)
    done = launcher.run(script, ["--ranks-per-node", str(RANKS_PER_NODE), *args,
                                 "--stop-after", str(steps), "--json-out", str(out)],
                        WORLD, work, RUN_TIMEOUT_SECONDS)
    if done.returncode != 0:
        raise RuntimeError(f"{script.name} {' '.join(args)} failed (exit {done.returncode}):\n"
                           f"{done.output[-4000:]}")
    return json.loads(out.read_text())["train_loss"]


def check_pair(runs: dict, pair: tuple[str, str], steps: int, launcher,
               work: Path) -> Verdict:
    """Probes `pair` (its reference row's first step) and, when comparable, reruns both rows
    for `steps` steps against their kept runs at seed 1."""
    reference, compressed = (runs[name][SEED] for name in pair)
    probe = first_difference(rerun(launcher, reference, 1, work), reference["train_loss"])
    if probe is not None:
        return Verdict(pair, False, (), f"not comparable here (another CPU, torch build or "
                                         f"Python standard library): {pair[0]} {probe} before "
                                         "any collective ran")
    problems = []
    for name, kept_run in zip(pair, (reference, compressed)):
        difference = first_difference(rerun(launcher, kept_run, steps, work),
                                      kept_run["train_loss"])
        if difference is not None:
            problems.append(f"{name} seed {SEED}: {difference}")
    note = (f"{steps} steps of each row bit-identical to the kept runs" if not problems
            else "; ".join(problems))
    return Verdict(pair, True, tuple(problems), note)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kept", type=Path, default=ROOT / "bench/results/convergence.json",
                   help="the study's convergence.json")
    p.add_argument("--steps", type=int, default=15, help="steps of each row to rerun")
    p.add_argument("--pairs", default=";".join(f"{a},{b}" for a, b in PAIRS),
                   help="reference,compressed row pairs, separated by ';'")
    p.add_argument("--require", action="store_true",
                   help="fail when no pair is comparable on this machine")
    args = p.parse_args(argv)
    args.pairs = [tuple(pair.split(",")) for pair in args.pairs.split(";")]
    if any(len(pair) != 2 for pair in args.pairs):
        p.error("--pairs: each pair is two row names separated by a comma")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    runs = json.loads(args.kept.read_text())["runs"]
    missing = sorted({n for pair in args.pairs for n in pair if SEED not in runs.get(n, {})})
    if missing:
        print(f"{args.kept} has no seed-{SEED} run of {', '.join(missing)}")
        return 1
    launcher = study_launcher()
    with tempfile.TemporaryDirectory() as work:
        verdicts = [check_pair(runs, pair, args.steps, launcher, Path(work))
                    for pair in args.pairs]
    for v in verdicts:
        print(f"{' / '.join(v.pair)}: {v.note}")
    if any(v.problems for v in verdicts):
        print("the current tree does not reproduce the kept study")
        return 1
    if not any(v.comparable for v in verdicts):
        print("no kept pair is comparable here" +
              (" (--require)" if args.require else ": nothing checked"))
        return 1 if args.require else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())

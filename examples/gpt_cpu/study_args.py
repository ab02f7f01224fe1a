"""The command line both training examples share (examples/gpt_cpu/train.py and
examples/fsdp2/train.py): bench/convergence.py runs either as a row of its study with these
flags, so they are defined once, with the same defaults, here."""

from __future__ import annotations

import argparse
import os

from data import DATA_SEEDINGS
from sdp4bit import presets


def study_parser(description: str, *, own: str, preset_help: str,
                 telemetry_help: str) -> argparse.ArgumentParser:
    """A parser with the study's arguments; `own` is the extra --preset value that selects the
    framework's own collectives, described (with the presets) by `preset_help`;
    `telemetry_help` says what --telemetry-interval measures against."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--preset", default="sdp4bit", choices=[*presets(), own], help=preset_help)
    p.add_argument("--knob", action="append", default=[], metavar="NAME=VALUE",
                   help="override one config knob (repeatable), e.g. --knob grad_codec=tlq")
    p.add_argument("--ranks-per-node", type=int,
                   default=int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
                   help="ranks per emulated node (intra- vs inter-node levels)")
    p.add_argument("--steps", type=int, default=60,
                   help="the run's length: the learning-rate schedule spans it")
    p.add_argument("--stop-after", type=int, metavar="N",
                   help="stop after the first N of --steps steps, the schedule unchanged (a "
                        "kept run's start, rerun to check it reproduces)")
    p.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    p.add_argument("--lr-decay", choices=["constant", "cosine"], default="constant",
                   help="after warm-up: constant, or cosine decay to --min-lr at the last step "
                        "(megatron-core's OptimizerParamScheduler)")
    p.add_argument("--warmup-steps", type=int, default=0)
    p.add_argument("--min-lr", type=float, default=3e-4)
    p.add_argument("--seed", type=int, default=1234,
                   help="initial weights, data order and sdp4bit's random streams")
    p.add_argument("--data-seeding", choices=DATA_SEEDINGS, default="hashed",
                   help="hashed: each rank's batches from a hash of (seed, rank); offset: seed + "
                        "1000 + rank, as the committed convergence study ran")
    p.add_argument("--corpus-bytes", type=int, default=4_000_000)
    p.add_argument("--val-tokens", type=int, default=65_536,
                   help="held-out tokens (the end of the corpus) the final validation loss "
                        "is measured on, each predicted once")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--telemetry-interval", type=int, default=20, help=telemetry_help)
    p.add_argument("--json-out", help="write the loss curve, byte counts and telemetry here "
                                      "(rank 0)")
    return p

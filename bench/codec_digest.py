"""A digest of the bytes every compressed preset's collectives produce on fixed data: two trees
(or two machines) whose digests are equal compute the same gradient shards and gathered
weights, bit for bit, for every preset, so a study kept from one holds for the other as far as
sdp4bit's numerics go.

    python bench/codec_digest.py            # one line per preset, then the digest of all

The cases are the codecs of the convergence study's rows (bench/convergence.py's ROWS). The
data come from SHAKE-256 (no library's random generator, whose streams may change between
versions); each preset runs the core's in-process reference collectives (the test build's
``simulate_grad_reduce_scatter`` and ``simulate_weight_all_gather``, the same code as the
distributed ones) on W = 4 ranks as 2 nodes x 2, over several steps, with a bucket size that
leaves a partial group and the knob seed 7. bench/results/codec_digest.md records the digest of
the tree the convergence study ran on; tests/python/test_codec_digest.py checks the tree
against it.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from convergence import ROWS  # noqa: E402
from sdp4bit import Config  # noqa: E402

LABELS = [0, 0, 1, 1]
NUMEL = 4 * 3001  # per-rank shards of 3001: partial groups and padding
STEPS = 3
BUCKET_ID = 5


def _floats(tag: str, count: int, scale: float) -> torch.Tensor:
    """`count` fp32 values in [-scale, scale) from SHAKE-256 of `tag`, with a few outliers."""
    raw = hashlib.shake_256(tag.encode()).digest(4 * count)
    words = torch.frombuffer(bytearray(raw), dtype=torch.int32).to(torch.float64)
    values = (words / 2**31 * scale).to(torch.float32)
    values[:: 997] *= 40.0  # outliers, as gradients have
    return values


def preset_digest(preset: str, knobs: dict[str, str]) -> str:
    """The SHA-256 of every output of `preset` with `knobs` over STEPS steps."""
    config = Config.from_knobs(preset, {"seed": "7", **knobs})
    ops = torch.ops.sdp4bit
    digest = hashlib.sha256()
    name = f"{preset}{sorted(knobs.items())}"
    if config.compresses_grads:
        for step in range(STEPS):
            inputs = torch.stack([_floats(f"grad {name} {step} {rank}", NUMEL, 1e-3)
                                  for rank in range(len(LABELS))])
            shards = ops.simulate_grad_reduce_scatter(config.spec(), LABELS, BUCKET_ID, step,
                                                      inputs)
            digest.update(shards.contiguous().view(torch.int32).numpy().tobytes())
    if config.compresses_weights:
        initial = _floats(f"weights {name}", NUMEL, 0.05).to(torch.bfloat16)
        targets = torch.stack([initial.float() + _floats(f"update {name} {step}", NUMEL, 1e-3)
                               for step in range(STEPS)]).to(torch.bfloat16)
        gathered = ops.simulate_weight_all_gather(config.spec(), LABELS, BUCKET_ID, 0,
                                                  initial, targets)
        digest.update(gathered.contiguous().view(torch.int16).numpy().tobytes())
    return digest.hexdigest()


def study_cases() -> list[tuple[str, dict[str, str]]]:
    """The preset and knobs of every row of the convergence study that compresses something,
    once each (the TP = 2 and FSDP2 rows run the codecs of TP = 1 rows)."""
    cases = []
    for row in ROWS.values():
        args = list(row.args)
        preset = args[args.index("--preset") + 1]
        knobs = dict(args[i + 1].split("=", 1) for i, a in enumerate(args) if a == "--knob")
        case = (preset, knobs)
        if preset != "baseline" and case not in cases:
            cases.append(case)
    return cases


def digests() -> dict[str, str]:
    """Each case's digest, by its name."""
    return {" ".join([preset, *(f"{k}={v}" for k, v in knobs.items())]):
            preset_digest(preset, knobs) for preset, knobs in study_cases()}


def combined(per_case: dict[str, str]) -> str:
    """One digest of every case's."""
    return hashlib.sha256("".join(f"{k}={v};" for k, v in per_case.items()).encode()).hexdigest()


def main() -> int:
    if not hasattr(torch.ops.sdp4bit, "simulate_grad_reduce_scatter"):
        sys.exit("bench/codec_digest.py needs sdp4bit's test build (the in-process reference "
                 "collectives): SDP4BIT_TEST_OPS=1 pip install . (the test command's build)")
    per_case = digests()
    for name, value in per_case.items():
        print(f"{name}: {value}")
    print(f"all: {combined(per_case)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

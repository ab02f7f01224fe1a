"""Runs a Hugging Face training script (examples/huggingface/train.py) as ``__main__`` and writes
what the tests compare, per rank, once ``Trainer.train`` returns; run by each rank under the
launcher being tested:

    python huggingface_scenarios.py RESULTS [--drop counters] SCRIPT [ARGS...]

RESULTS/rank<r>.pt holds the rank's bf16 model bits and fp32 master bits, a digest of its bf16
model after every optimizer step, the logs a callback after sdp4bit's receives, the Trainer's
log history, sdp4bit's byte counters and
weight error, and the error of rounding the masters to bf16 alone. ``--drop counters`` (the
resume test's control) loads checkpoints without sdp4bit's saved step counters.
"""

from __future__ import annotations

import hashlib
import runpy
import sys
from pathlib import Path

import torch
import transformers
from transformers import TrainerCallback

import sdp4bit.deepspeed
import sdp4bit.huggingface


def _bits(tensors) -> torch.Tensor:
    """The tensors' bits, concatenated (bf16 as int16, fp32 as int32, widened to int32)."""
    views = {torch.bfloat16: torch.int16, torch.float32: torch.int32}
    return torch.cat([t.detach().reshape(-1).view(views[t.dtype]).to(torch.int32)
                      for t in tensors])


class Observer(TrainerCallback):
    """The SHA-256 of the bf16 model's bits after each optimizer step, and each log as a
    callback added after sdp4bit's (as a reporting integration) receives it."""

    def __init__(self):
        self.digests: list[str] = []
        self.logs: list[dict] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs))

    def on_step_end(self, args, state, control, model=None, **kwargs):
        bits = _bits(model.parameters()).numpy().tobytes()
        self.digests.append(hashlib.sha256(bits).hexdigest())


def _bf16_rounding_error(zero) -> float:
    """Relative L2 distance of this rank's fp32 masters from their bf16 rounding: the weight
    error without any compression."""
    diff_sq = ref_sq = 0.0
    for master in zero.single_partition_of_fp32_groups:
        exact = master.detach().double()
        diff_sq += float((master.detach().bfloat16().double() - exact).pow(2).sum())
        ref_sq += float(exact.pow(2).sum())
    return (diff_sq / ref_sq) ** 0.5


def record_training(results: Path) -> None:
    """Wraps ``Trainer.train`` so that each rank writes its results to `results` after it."""
    train = transformers.Trainer.train

    def recorded_train(trainer, *args, **kwargs):
        observer = Observer()
        trainer.add_callback(observer)
        outcome = train(trainer, *args, **kwargs)
        zero = trainer.model_wrapped.optimizer
        rank = trainer.args.process_index
        torch.save({
            "model": _bits(trainer.model.parameters()),
            "masters": _bits(zero.single_partition_of_fp32_groups),
            "digests": observer.digests,
            "logs": observer.logs,
            "log_history": trainer.state.log_history,
            "wire_bytes": sdp4bit.deepspeed.wire_bytes(zero),
            "weight_error": sdp4bit.huggingface.weight_error(zero),
            "bf16_rounding_error": _bf16_rounding_error(zero),
        }, results / f"rank{rank}.pt")
        return outcome

    transformers.Trainer.train = recorded_train


def main(argv: list[str]) -> None:
    results, argv = Path(argv[0]), argv[1:]
    if argv[:2] == ["--drop", "counters"]:
        from deepspeed_resume_scenarios import _drop

        _drop("counters")
        argv = argv[2:]
    results.mkdir(parents=True, exist_ok=True)
    record_training(results)
    sys.argv = argv
    sys.path.insert(0, str(Path(argv[0]).resolve().parent))
    runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])

"""Telemetry of the compressed collectives: bytes sent against the uncompressed baseline (and
those of them that carried parameters kept exact), and
at a configurable interval the quantization error, measured against Megatron's own exact
collective run on the same data (which costs one uncompressed collective on those steps only).
Shown through :func:`announce` and written to the tensorboard and wandb writers given."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from .groups import is_first_rank

logger = logging.getLogger("sdp4bit")


def announce(message: str) -> None:
    """Shows `message` (a start-up line, a telemetry report) from the job's rank 0 alone
    (:func:`~sdp4bit.groups.is_first_rank`, from the launcher before torch.distributed is
    initialized) as the frameworks show theirs: an INFO record of the ``sdp4bit`` logger where
    logging is set up to show it, else printed (as Megatron's ``print_rank_0``), since Python drops INFO records nobody configured
    a handler for. A level set on the ``sdp4bit`` logger itself is obeyed (``WARNING``
    silences these lines)."""
    if not is_first_rank():
        return
    if logger.level != logging.NOTSET or (logger.hasHandlers()
                                          and logger.isEnabledFor(logging.INFO)):
        logger.info(message)
    else:
        print(message, flush=True)


@dataclass
class ErrorStats:
    """How far compressed results are from the exact ones (mergeable sums)."""

    diff_sq: float = 0.0  # sum of (got - exact)^2 over finite elements
    ref_sq: float = 0.0  # sum of exact^2 over the same elements
    max_abs: float = 0.0  # max |got - exact| over finite elements
    nonfinite: int = 0  # elements that are NaN/Inf in the compressed result only

    @property
    def rel_l2(self) -> float:
        return (self.diff_sq / self.ref_sq) ** 0.5 if self.ref_sq > 0 else 0.0

    @staticmethod
    def of(got: list[torch.Tensor], exact: list[torch.Tensor]) -> ErrorStats:
        stats = ErrorStats()
        for g, e in zip(got, exact):
            g, e = g.float(), e.float()
            finite = torch.isfinite(g) & torch.isfinite(e)
            stats.nonfinite += int((~torch.isfinite(g) & torch.isfinite(e)).sum())
            d = (g - e)[finite]
            stats.diff_sq += float(d.double().pow(2).sum())
            stats.ref_sq += float(e[finite].double().pow(2).sum())
            if d.numel():
                stats.max_abs = max(stats.max_abs, float(d.abs().max()))
        return stats

    def merge(self, other: ErrorStats) -> None:
        self.diff_sq += other.diff_sq
        self.ref_sq += other.ref_sq
        self.max_abs = max(self.max_abs, other.max_abs)
        self.nonfinite += other.nonfinite


@dataclass
class _Step:
    reports: int = 0
    sent: int = 0
    baseline: int = 0
    exact: int = 0
    error: ErrorStats = field(default_factory=ErrorStats)


def _resolved(writer):
    """`writer`, or what it returns when it is a function (e.g. Megatron-LM's getters)."""
    return writer() if callable(writer) and not hasattr(writer, "log") else writer


class Telemetry:
    """Reports every `interval` steps (0: never) through :func:`announce`, to a tensorboard
    `writer` (``add_scalar``) and to a Weights & Biases `wandb_writer` (``log``, as the
    ``wandb`` module or a run), each given as the object or a function returning it or None
    (Megatron-LM's ``get_tensorboard_writer`` / ``get_wandb_writer``). Bucket groups report
    separately; a step is emitted once all of them have."""

    def __init__(self, interval: int, writer=None, wandb_writer=None):
        if interval < 0:
            raise ValueError(f"sdp4bit: telemetry interval must be >= 0, got {interval}")
        self.interval, self._writer, self._wandb = interval, writer, wandb_writer
        self._open: dict[tuple[str, int], _Step] = {}

    def due(self, step: int) -> bool:
        return self.interval > 0 and step % self.interval == 0

    def report(self, what: str, step: int, groups: int, sent: int, baseline: int,
               error: ErrorStats, exact: int = 0) -> None:
        """One bucket group's numbers for `what` ("grad" or "param") at `step`, of `groups`;
        `exact` of the `sent` bytes carried parameters kept exact."""
        acc = self._open.setdefault((what, step), _Step())
        acc.reports += 1
        acc.sent += sent
        acc.baseline += baseline
        acc.exact += exact
        acc.error.merge(error)
        if acc.reports >= groups:
            del self._open[(what, step)]
            self._emit(what, step, acc)

    def _emit(self, what: str, step: int, acc: _Step) -> None:
        e = acc.error
        values = {"bytes_sent": acc.sent, "bytes_uncompressed": acc.baseline,
                  "bytes_exact": acc.exact,
                  "rel_l2_error": e.rel_l2, "max_abs_error": e.max_abs, "nonfinite": e.nonfinite}
        named = {f"sdp4bit/{what}/{name}": value for name, value in values.items()}
        writer = _resolved(self._writer)
        if writer is not None:
            for name, value in named.items():
                writer.add_scalar(name, value, step)
        wandb = _resolved(self._wandb)
        if wandb is not None:
            wandb.log(named, step=step)
        ratio = f"{acc.baseline / acc.sent:.2f}x less" if acc.sent else "nothing sent"
        announce(
            f"sdp4bit {what} step {step}: {acc.sent:,d} B sent ({acc.exact:,d} B of them "
            f"exact) vs {acc.baseline:,d} B "
            f"({ratio}); error rel-L2 {e.rel_l2:.3e}, max {e.max_abs:.3e}, "
            f"{e.nonfinite} new non-finite"
        )

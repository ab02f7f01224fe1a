"""Training text that ships with Python: the standard library's sources, as bytes, split into
a training part and a held-out validation part."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import torch


def stdlib_corpus(max_bytes: int) -> torch.Tensor:
    """The first `max_bytes` bytes of the standard library's .py files in sorted order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    data = b"".join(chunks)[:max_bytes]
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def split(corpus: torch.Tensor, held_out: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(training, validation): the last `held_out` fraction is validation."""
    cut = int(len(corpus) * (1.0 - held_out))
    return corpus[:cut], corpus[cut:]


def batch(text: torch.Tensor, size: int, context: int, generator: torch.Generator):
    """`size` random windows of `context` + 1 bytes: (inputs, next-byte targets)."""
    starts = torch.randint(0, len(text) - context - 1, (size,), generator=generator)
    windows = torch.stack([text[s:s + context + 1] for s in starts.tolist()])
    return windows[:, :-1], windows[:, 1:]

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


def split(corpus: torch.Tensor, held_out: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(training, validation): the last `held_out` bytes are validation; raises when that
    leaves less training text than validation text."""
    if not 0 < held_out <= len(corpus) // 2:
        raise ValueError(f"{held_out:,d} held-out bytes of a {len(corpus):,d}-byte corpus: "
                         "ask for more corpus bytes or fewer validation tokens")
    return corpus[:-held_out], corpus[-held_out:]


def batch(text: torch.Tensor, size: int, context: int, generator: torch.Generator):
    """`size` windows of `context` + 1 bytes at random offsets ([size, context + 1]): the
    inputs and, shifted by one, their next-byte targets."""
    starts = torch.randint(0, len(text) - context - 1, (size,), generator=generator)
    return torch.stack([text[s:s + context + 1] for s in starts.tolist()])


def validation_windows(text: torch.Tensor, context: int) -> torch.Tensor:
    """Windows of `context` + 1 bytes at a stride of `context`: every byte of `text` after the
    first is predicted exactly once."""
    count = (len(text) - 1) // context
    return torch.stack([text[i * context:i * context + context + 1] for i in range(count)])

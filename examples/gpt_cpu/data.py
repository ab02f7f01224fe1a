"""Training text that ships with Python: the standard library's sources, as bytes, split into
a training part and a held-out validation part."""

from __future__ import annotations

import hashlib
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


#: How a rank's batch stream is seeded (``--data-seeding``). "hashed": from a hash of (study
#: seed, DP rank, "data"), so every seed's and rank's stream is independent of every other's.
#: "offset": seed + 1000 + rank, the seeding of the convergence study committed in
#: bench/results (its adjacent seeds share 3 of their 4 ranks' streams), kept so that its runs
#: can be rerun as they ran.
DATA_SEEDINGS = ("hashed", "offset")


def batch_generator(seed: int, dp_rank: int, seeding: str = "hashed") -> torch.Generator:
    """The generator of DP rank `dp_rank`'s training batches for the run seed `seed`."""
    if seeding == "offset":
        return torch.Generator().manual_seed(seed + 1000 + dp_rank)
    if seeding != "hashed":
        raise ValueError(f"data seeding {seeding!r}: one of {', '.join(DATA_SEEDINGS)}")
    digest = hashlib.blake2b(f"{seed}/{dp_rank}/data".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little"))


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

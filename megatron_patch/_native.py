"""Loads the compiled extension, which registers torch.ops.sdp4bit and torch.classes.sdp4bit."""

from __future__ import annotations

import functools
from pathlib import Path

import torch


@functools.cache
def load() -> None:
    """Loads `_sdp4bit*.so` from this package once; raises ImportError if it was not built."""
    here = Path(__file__).resolve().parent
    candidates = sorted(here.glob("_sdp4bit*.so"))
    if not candidates:
        raise ImportError(
            f"sdp4bit: the compiled extension is missing from {here}; install the package "
            "with `pip install .` from the repository (it builds the Rust core and the "
            "extension against the installed torch)"
        )
    torch.ops.load_library(str(candidates[0]))


def ops():
    """torch.ops.sdp4bit, loaded."""
    load()
    return torch.ops.sdp4bit


def classes():
    """torch.classes.sdp4bit, loaded."""
    load()
    return torch.classes.sdp4bit

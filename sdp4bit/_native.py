"""Loads the compiled extension, which registers torch.ops.sdp4bit and torch.classes.sdp4bit,
and reads what the Rust core knows about itself (presets, knobs, limits)."""

from __future__ import annotations

import functools
import json
import os
import sys
from pathlib import Path

import torch

#: The directories the core searches for NVRTC when ``SDP4BIT_NVRTC_LIBRARY`` is unset and the
#: loader finds none (separated by ``os.pathsep``); :func:`load` sets it, if unset, to
#: :func:`nvrtc_dirs`.
NVRTC_DIRS_VAR = "SDP4BIT_NVRTC_DIRS"


def nvrtc_dirs() -> list[Path]:
    """The ``lib`` directories of pip's ``nvidia`` packages on ``sys.path``, where a CUDA torch's
    wheels put NVRTC (``nvidia/cu13/lib``; ``nvidia/cuda_nvrtc/lib`` for CUDA 12). The core picks
    the NVRTC of the driver's CUDA version among them (docs/cuda.md)."""
    dirs = [lib for entry in sys.path if entry
            for lib in sorted((Path(entry).absolute() / "nvidia").glob("*/lib")) if lib.is_dir()]
    return list(dict.fromkeys(dirs))


@functools.cache
def load() -> None:
    """Loads `_sdp4bit*.so` from this package once; raises ImportError if it was not built, or
    was built against another torch than this interpreter's (torch's C++ ABI differs between
    releases, so loading it could crash later instead of failing now). Sets
    ``SDP4BIT_NVRTC_DIRS`` first, if unset, so that a process without NVRTC on the loader's path
    (a torch user's, typically) compiles the CUDA kernels with the torch wheels' NVRTC."""
    os.environ.setdefault(NVRTC_DIRS_VAR, os.pathsep.join(str(d) for d in nvrtc_dirs()))
    here = Path(__file__).resolve().parent
    candidates = sorted(here.glob("_sdp4bit*.so"))
    if not candidates:
        raise ImportError(
            f"sdp4bit: the compiled extension is missing from {here}; install the package "
            "with `pip install .` from the repository (it builds the Rust core and the "
            "extension against the installed torch)"
        )
    built_with = candidates[0].with_name(candidates[0].stem + ".torch-version")
    if built_with.is_file():
        version = built_with.read_text().strip()
        if version != torch.__version__:
            raise ImportError(
                f"sdp4bit: the extension in {here} was built against torch {version}, but this "
                f"interpreter has torch {torch.__version__}; reinstall sdp4bit after changing "
                "torch (pip install --no-deps --force-reinstall <the sdp4bit source>)"
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


@functools.cache
def schema() -> dict:
    """The core's presets, knobs (name, accepted values, doc) and limits
    (``torch.ops.sdp4bit.schema()``), parsed."""
    return json.loads(ops().schema())

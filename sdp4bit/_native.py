"""Finds and loads the compiled extension, which registers torch.ops.sdp4bit and
torch.classes.sdp4bit, and reads what the Rust core knows about itself (presets, knobs, limits)."""

from __future__ import annotations

import functools
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from . import _jit, _torch_abi

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


@dataclass(frozen=True)
class Extension:
    """The compiled extension this process loads: its file, and how it came to be there
    (``built at install`` by ``pip install`` from source, or ``compiled at first import`` from a
    portable wheel's bundle)."""

    path: Path
    origin: str


@functools.cache
def extension() -> Extension:
    """The extension for this interpreter's torch: the one ``pip install`` built from source into
    the package (refused when it records another torch ABI), else a portable wheel's, compiled
    at first import (``sdp4bit._jit``); raises ImportError when neither is there."""
    here = Path(__file__).resolve().parent
    candidates = sorted(here.glob("_sdp4bit*.so"))
    if candidates:
        built = _torch_abi.read_record(candidates[0])
        why = built and _torch_abi.mismatch(built, _torch_abi.installed())
        if why:
            raise ImportError(
                f"sdp4bit: the extension in {here} cannot be loaded: {why}; reinstall sdp4bit "
                "after changing torch (pip install --no-deps --force-reinstall <the sdp4bit "
                "source>)")
        return Extension(candidates[0], "built at install")
    if (_jit.bundle_dir() / _jit.MANIFEST).is_file():
        return Extension(_jit.library(_jit.bundle_dir()), "compiled at first import")
    raise ImportError(
        f"sdp4bit: the compiled extension is missing from {here}; install the package with "
        "`pip install .` from the repository (it builds the Rust core and the extension against "
        "the installed torch) or from a portable wheel (docs/install.md)")


@functools.cache
def load() -> None:
    """Loads the extension (:func:`extension`) once. Sets ``SDP4BIT_NVRTC_DIRS`` first, if
    unset, so that a process without NVRTC on the loader's path (a torch user's, typically)
    compiles the CUDA kernels with the torch wheels' NVRTC."""
    os.environ.setdefault(NVRTC_DIRS_VAR, os.pathsep.join(str(d) for d in nvrtc_dirs()))
    torch.ops.load_library(str(extension().path))


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

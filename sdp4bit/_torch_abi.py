"""What the extension's C++ ABI depends on in a torch build, and the record of it kept beside a
compiled extension.

torch's C++ ABI changes between releases and with the C++11 ABI flag it was built with; the
local part of its version (``+cu130``, an NGC build's ``+<sha>``) names the CUDA runtime or the
commit, and the extension includes no CUDA header. So two torch builds are compatible here when
their public versions (the release, with any pre-release marker: ``2.9.0a0``) and their C++11
ABI flags are equal. This module does not import torch (setup.py loads it by path).
"""

from __future__ import annotations

import json
from pathlib import Path

#: The record's file name beside the extension ``_sdp4bit.so``.
RECORD_SUFFIX = ".torch-version"


def abi_tag(version: str, cxx11_abi: bool | None) -> str:
    """``2.11.0-cxx11abi1`` for torch ``2.11.0+cu130`` built with the C++11 ABI (``-cxx11abi?``
    when the flag is unknown)."""
    public = version.split("+", 1)[0]
    if not public or not public[0].isdigit():
        raise ValueError(f"sdp4bit: {version!r} is not a torch version")
    return f"{public}-cxx11abi{'?' if cxx11_abi is None else int(bool(cxx11_abi))}"


def installed() -> dict:
    """The torch of this interpreter: its version and C++11 ABI flag."""
    import torch

    return {"torch": torch.__version__, "cxx11_abi": bool(torch._C._GLIBCXX_USE_CXX11_ABI)}


def tag_of(record: dict) -> str:
    """The ABI tag of a record made by :func:`installed`."""
    return abi_tag(record["torch"], record["cxx11_abi"])


def record_path(library: Path) -> Path:
    """Where the record of ``library`` (``_sdp4bit.so``) lives: ``_sdp4bit.torch-version``."""
    return library.with_name(library.stem + RECORD_SUFFIX)


def write_record(library: Path, record: dict) -> None:
    """Records beside ``library`` the torch it was compiled against."""
    record_path(library).write_text(json.dumps(record, sort_keys=True) + "\n")


def read_record(library: Path) -> dict | None:
    """The torch ``library`` was compiled against; None when no record is there. A record of an
    earlier release holds the version alone (its C++11 ABI flag is then unknown)."""
    try:
        text = record_path(library).read_text().strip()
    except FileNotFoundError:
        return None
    record = json.loads(text) if text.startswith("{") else {"torch": text, "cxx11_abi": None}
    tag_of(record)
    return record


def mismatch(built: dict, running: dict) -> str | None:
    """Why an extension compiled against ``built`` must not be loaded under ``running``, or
    None when their ABI tags are equal (the flag compared only where both are known)."""
    known = built["cxx11_abi"] is not None
    ours = tag_of(running if known else {**running, "cxx11_abi": None})
    if tag_of(built) == ours:
        return None
    return (f"it was built against torch {built['torch']} ({tag_of(built)}), but this "
            f"interpreter has torch {running['torch']} ({tag_of(running)})")


def stale(library: Path, running: dict) -> bool:
    """Whether ``library``, found already built, must be rebuilt for ``running``: nothing records
    its torch, the record is an earlier release's (which named the torch it was installed for,
    not always the one it was compiled against), or it names another ABI."""
    built = read_record(library)
    return built is None or built["cxx11_abi"] is None or mismatch(built, running) is not None

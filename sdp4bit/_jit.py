"""The portable wheel's torch glue, compiled at first import against the installed torch.

A portable wheel (docs/install.md) carries, in ``sdp4bit/_bundle/``, the Rust core prebuilt
(``lib/libsdp4bit.a`` with its bridge headers) and the C++ sources of the torch extension
(``cpp/``), with ``manifest.json`` naming the sources and a digest of every file. The first
import compiles the sources with torch's C++ extension builder (g++ and ninja) and links them
with the core; the library is cached per bundle, torch ABI (release and C++11 ABI flag) and
Python, so each torch build compiles once. Concurrent first imports (the ranks of one node)
compile once: the first takes an advisory lock (``flock``) beside the cache entry and the
others wait on it, then load what it built. The kernel drops the lock when its holder dies, so
a compile killed half-way leaves nothing that blocks the next import; torch's own lock file in
the entry, which a killed compile leaves behind, is removed under that lock.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import sys
from pathlib import Path

from . import _torch_abi

#: Where compiled extensions are cached (default ``$XDG_CACHE_HOME/sdp4bit`` or
#: ``~/.cache/sdp4bit``).
CACHE_VAR = "SDP4BIT_EXTENSIONS_DIR"
#: The extension's name as torch's builder knows it (the library is ``NAME.so``).
NAME = "sdp4bit_ext"
MANIFEST = "manifest.json"
DONE = "sdp4bit-built.json"
#: The lock file torch's builder (``torch.utils.file_baton``) keeps in its build directory.
TORCH_BATON = "lock"


def bundle_dir() -> Path:
    """Where a portable wheel puts its bundle in the package."""
    return Path(__file__).resolve().parent / "_bundle"


def cache_root() -> Path:
    """The directory the compiled extensions are cached under."""
    if os.environ.get(CACHE_VAR):
        return Path(os.environ[CACHE_VAR])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "sdp4bit"


def build_dir(manifest: dict, torch_record: dict, python_tag: str) -> Path:
    """The cache entry of one bundle compiled against one torch ABI under one Python."""
    key = f"{manifest['digest'][:16]}-torch{_torch_abi.tag_of(torch_record)}-{python_tag}"
    return cache_root() / key


def cached_library(directory: Path, torch_record: dict) -> Path | None:
    """The library compiled in ``directory`` earlier, when its record says it completed for
    this torch ABI; None otherwise."""
    library = directory / f"{NAME}.so"
    try:
        done = json.loads((directory / DONE).read_text())
    except (OSError, ValueError):
        return None
    if not library.is_file() or _torch_abi.mismatch(done, torch_record) is not None:
        return None
    return library


def _put_ninja_on_path() -> None:
    """torch's builder runs ``ninja`` from PATH; a launcher's ranks may not have the virtual
    environment's ``bin`` there, so pip's ninja package is found by import too."""
    if shutil.which("ninja"):
        return
    try:
        import ninja

        found = ninja.BIN_DIR
    except ImportError:
        found = ""
    if not found:
        raise ImportError(
            "sdp4bit: compiling the torch extension at first import needs ninja on PATH or the "
            "ninja package (pip install ninja), and g++ (docs/install.md)")
    os.environ["PATH"] = found + os.pathsep + os.environ.get("PATH", "")


def compile_library(bundle: Path, directory: Path, torch_record: dict) -> Path:
    """Compiles the bundle's C++ sources against this interpreter's torch into ``directory``
    and links them with the prebuilt core; returns the library (not yet loaded)."""
    from torch.utils import cpp_extension

    manifest = json.loads((bundle / MANIFEST).read_text())
    _put_ninja_on_path()
    directory.mkdir(parents=True, exist_ok=True)
    defines = ["-DSDP4BIT_TEST_OPS"] if "test-ops" in manifest["features"] else []
    print(f"sdp4bit: compiling the torch extension for torch {torch_record['torch']} into "
          f"{directory} (once per torch build; g++ takes a minute or more)", file=sys.stderr)
    try:
        path = cpp_extension.load(
            name=NAME,
            sources=[str(bundle / "cpp" / s) for s in manifest["sources"]],
            extra_include_paths=[str(bundle / "cpp"), str(bundle / "include")],
            extra_cflags=["-O2", *defines],
            extra_ldflags=[str(bundle / "lib" / "libsdp4bit.a"), "-ldl", "-lpthread", "-lm"],
            build_directory=str(directory),
            is_python_module=False,
            verbose=False,
        )
    except (RuntimeError, OSError, ImportError) as e:
        raise ImportError(
            f"sdp4bit: compiling the torch extension against torch {torch_record['torch']} "
            f"in {directory} failed (it needs g++ and ninja; docs/install.md): {e}") from e
    done = directory / f"{DONE}.{os.getpid()}"
    done.write_text(json.dumps(torch_record, sort_keys=True) + "\n")
    done.replace(directory / DONE)
    return Path(path)


@contextlib.contextmanager
def exclusive(directory: Path):
    """Holds the advisory lock of the cache entry ``directory`` (a ``.lock`` file beside it);
    the kernel releases it when the holder exits, however it exits."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    with open(directory.with_name(directory.name + ".lock"), "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def library(bundle: Path) -> Path:
    """The bundle's extension for this interpreter's torch: cached, else compiled now (one
    process at a time per cache entry)."""
    manifest = json.loads((bundle / MANIFEST).read_text())
    torch_record = _torch_abi.installed()
    directory = build_dir(manifest, torch_record, sys.implementation.cache_tag)
    cached = cached_library(directory, torch_record)
    if cached is not None:
        return cached
    with exclusive(directory):
        cached = cached_library(directory, torch_record)
        if cached is not None:
            return cached
        # Whoever held torch's lock here was killed: no live process compiles in this entry.
        (directory / TORCH_BATON).unlink(missing_ok=True)
        return compile_library(bundle, directory, torch_record)

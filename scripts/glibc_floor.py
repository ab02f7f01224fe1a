"""The oldest glibc a static archive links against: the portable wheel's platform tag.

    python scripts/glibc_floor.py ARCHIVE      prints the tag and the symbols that set it

auditwheel computes a wheel's manylinux tag from the versioned glibc symbols its shared objects
bind; the portable wheel holds none, only the core as a static archive that the first import
links on the user's host (docs/install.md). The same question is asked of the archive instead:
every symbol its members reference strongly and none of them defines must exist in the user's
glibc, so the tag's glibc is the newest release among the ones that introduced those symbols
(read from the build host's glibc, whose version nodes record each symbol's first release).
Weak references (Rust's standard library takes newer calls such as `statx` that way) need
nothing. The floor is never below 2.17, Rust's own for x86-64 Linux.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

#: Rust's standard library needs glibc 2.17 on x86-64 Linux.
RUST_FLOOR = (2, 17)
#: glibc's libraries whose version nodes say when each symbol appeared.
GLIBC_LIBRARIES = ("libc.so.6", "libm.so.6", "libpthread.so.0", "libdl.so.2", "librt.so.1",
                   "ld-linux-x86-64.so.2")
#: Exported by glibc only since 2.33; before, libc_nonshared.a, which every link against
#: libc.so takes, defined them as wrappers, so an archive referencing them links on any glibc.
NONSHARED_BEFORE_2_33 = frozenset(
    f"{name}{suffix}" for name in ("stat", "fstat", "lstat", "fstatat", "mknod", "mknodat")
    for suffix in ("", "64"))

_SYMBOL_LINE = re.compile(r"^\s*\d+:\s+\S+\s+\d+\s+\S+\s+(GLOBAL|WEAK|LOCAL)\s+\S+\s+(\S+)\s+(\S+)")
_VERSION = re.compile(r"@@?GLIBC_(\d+)\.(\d+)")


def _readelf(*args: str) -> str:
    return subprocess.run(["readelf", "-W", *args], check=True, capture_output=True,
                          text=True).stdout


def archive_needs(archive: Path) -> tuple[set[str], set[str]]:
    """The symbols `archive`'s members reference but none defines: (strong, weak only)."""
    defined: set[str] = set()
    strong: set[str] = set()
    weak: set[str] = set()
    for line in _readelf("--syms", str(archive)).splitlines():
        match = _SYMBOL_LINE.match(line)
        if not match:
            continue
        bind, section, name = match.groups()
        if bind == "LOCAL":
            continue
        if section != "UND":
            defined.add(name)
        elif bind == "WEAK":
            weak.add(name)
        else:
            strong.add(name)
    return strong - defined, weak - defined - strong


def glibc_introductions() -> dict[str, tuple[int, int]]:
    """Each symbol the build host's glibc exports, with the first release that had it."""
    first: dict[str, tuple[int, int]] = {}
    for library in GLIBC_LIBRARIES:
        path = subprocess.run(["gcc", f"-print-file-name={library}"], check=True,
                              capture_output=True, text=True).stdout.strip()
        if not Path(path).is_file():
            continue
        for line in _readelf("--dyn-syms", path).splitlines():
            match = _SYMBOL_LINE.match(line)
            version = _VERSION.search(line)
            if not match or not version or match.group(2) == "UND":
                continue
            name = match.group(3).split("@")[0]
            release = (int(version.group(1)), int(version.group(2)))
            first[name] = min(first.get(name, release), release)
    if not first:
        raise RuntimeError("sdp4bit: no glibc found through gcc -print-file-name")
    return first


def floor(archive: Path) -> tuple[tuple[int, int], dict[str, tuple[int, int]]]:
    """The oldest glibc `archive` links against, and the glibc symbols it needs with the
    release each appeared in."""
    strong, _weak = archive_needs(archive)
    first = glibc_introductions()
    needed = {name: first[name] for name in strong if name in first}
    for name in NONSHARED_BEFORE_2_33 & needed.keys():
        needed[name] = RUST_FLOOR
    return max([RUST_FLOOR, *needed.values()]), needed


def platform_tag(archive: Path) -> str:
    """The manylinux platform tag of a wheel carrying `archive` (x86-64)."""
    (major, minor), _needed = floor(archive)
    return f"manylinux_{major}_{minor}_x86_64"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("archive", type=Path)
    args = parser.parse_args()
    release, needed = floor(args.archive)
    print(platform_tag(args.archive))
    newest = sorted(needed.items(), key=lambda item: (item[1], item[0]))[-5:]
    for name, (major, minor) in reversed(newest):
        print(f"  {name}: glibc {major}.{minor}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The portable wheel's platform tag (scripts/glibc_floor.py): the oldest glibc its static core
links against, from the symbols the archive needs. Checked on archives made here from C
sources whose needs are known; the wheel's own tag in tests/python/test_wheel.py."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def glibc_floor(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import glibc_floor

    return glibc_floor


def archive(tmp_path: Path, **sources: str) -> Path:
    """A static archive of the C sources given as name=text, compiled by gcc."""
    objects = []
    for name, text in sources.items():
        (tmp_path / f"{name}.c").write_text(text)
        subprocess.run(["gcc", "-O1", "-c", f"{name}.c", "-o", f"{name}.o"], cwd=tmp_path,
                       check=True)
        objects.append(f"{name}.o")
    subprocess.run(["ar", "rcs", "lib.a", *objects], cwd=tmp_path, check=True)
    return tmp_path / "lib.a"


def test_a_strong_reference_to_a_new_symbol_sets_the_floor(glibc_floor, tmp_path):
    # arc4random appeared in glibc 2.36 (the build host's own release).
    lib = archive(tmp_path, a="""
        #include <stdint.h>
        uint32_t arc4random(void);
        uint32_t draw(void) { return arc4random(); }""")
    assert glibc_floor.platform_tag(lib) == "manylinux_2_36_x86_64"


def test_weak_stat_and_internal_references_need_nothing_newer_than_rust(glibc_floor, tmp_path):
    lib = archive(
        tmp_path,
        weak="""
            #include <stdint.h>
            __attribute__((weak)) uint32_t arc4random(void);
            uint32_t draw(void) { return arc4random ? arc4random() : 4; }""",
        stat="""
            #define _LARGEFILE64_SOURCE
            #include <sys/stat.h>
            long size(const char *p) { struct stat64 s; return stat64(p, &s) ? -1 : s.st_size; }""",
        # defined in a member of the archive: not the user's glibc's business
        own="""
            unsigned arc4random_uniform(unsigned n) { return n / 2; }
            unsigned half(unsigned n) { return arc4random_uniform(n); }""")
    release, needed = glibc_floor.floor(lib)
    assert release == glibc_floor.RUST_FLOOR
    assert "stat64" in needed and "arc4random" not in needed
    assert "arc4random_uniform" not in needed

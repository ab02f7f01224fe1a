"""Builds the portable wheel: it installs without Rust (docs/install.md).

    python scripts/build_wheel.py --out DIR

The Rust core is built by cargo without the tests' references (or taken from the native bundle
SDP4BIT_NATIVE_DIR names, which must not have them either) and goes into the wheel prebuilt,
beside the torch extension's C++ sources, which the first import compiles against the installed
torch (sdp4bit/_jit.py). torch is not needed here. The wheel is checked before its path is
printed: the bundle and its manifest are in it, no compiled Python extension is.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BUNDLE = "sdp4bit/_bundle"
NEEDED = [f"{BUNDLE}/manifest.json", f"{BUNDLE}/lib/libsdp4bit.a",
          f"{BUNDLE}/include/sdp4bit/src/ffi/mod.rs.h", f"{BUNDLE}/cpp/sdp4bit_ops.cpp"]


def build(out: Path) -> Path:
    """Builds the wheel into `out` (emptied first); returns its path."""
    env = dict(os.environ, SDP4BIT_PORTABLE_WHEEL="1")
    env.pop("SDP4BIT_TEST_OPS", None)
    # setuptools stages the package in build/lib; nothing of an earlier build may come along.
    shutil.rmtree(REPO / "build" / "lib", ignore_errors=True)
    if out.exists():
        shutil.rmtree(out)
    command = [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps",
               "--no-build-isolation", "--wheel-dir", str(out), str(REPO)]
    subprocess.run(command, env=env, check=True)
    [wheel] = out.glob("sdp4bit-*.whl")
    check(wheel)
    return wheel


def check(wheel: Path) -> None:
    """Raises unless `wheel` holds the bundle, a manifest of a build without the tests'
    references, and no compiled Python extension."""
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        missing = [n for n in NEEDED if n not in names]
        if missing:
            raise RuntimeError(f"sdp4bit: the wheel {wheel} lacks {', '.join(missing)}")
        extensions = sorted(n for n in names if n.endswith(".so"))
        if extensions:
            raise RuntimeError(f"sdp4bit: the portable wheel {wheel} holds compiled extensions "
                               f"{extensions}; they belong to one torch")
        features = json.loads(archive.read(f"{BUNDLE}/manifest.json"))["features"]
    if features != ["ffi"]:
        raise RuntimeError(f"sdp4bit: the wheel's core was built with the features {features}; "
                           "a wheel carries `ffi` only (unset SDP4BIT_TEST_OPS)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="directory to write the wheel to")
    args = parser.parse_args()
    print(build(args.out.resolve()))
    return 0


if __name__ == "__main__":
    sys.exit(main())

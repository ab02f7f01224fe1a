"""Builds the Rust static library with its cxx bridge and stages it for the torch extension.

The staged directory (a "native bundle") is what `setup.py` compiles the extension against:

    <dir>/lib/libsdp4bit.a                      the Rust core with the bridge's C++ half
    <dir>/include/rust/cxx.h                    cxx's C++ runtime header
    <dir>/include/sdp4bit/src/ffi/mod.rs.h      the generated bridge header
    <dir>/include/sdp4bit/cpp/torch_comms.h     the C++ side's declarations
    <dir>/features.txt                          the cargo features it was built with

With SDP4BIT_TEST_OPS=1 (set by the test command) the core is built with the cargo feature
`test-ops` as well, and the extension then registers the tests' in-process references
(`torch.ops.sdp4bit.simulate_*`); without it, they are not in the library at all.

Hosts without a Rust toolchain install from a bundle built elsewhere:

    python scripts/build_native.py --out /path/to/bundle          # where cargo is
    SDP4BIT_NATIVE_DIR=/path/to/bundle pip install .              # where it is not

In an unpacked sdist, which carries the crates in vendor/ (`cargo vendor`, setup.py), cargo
builds from them offline instead of fetching from crates.io.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
HEADERS = ("rust/cxx.h", "sdp4bit/src/ffi/mod.rs.h")
FEATURES_FILE = "features.txt"
#: The crates of Cargo.lock, vendored into an sdist.
VENDOR_DIR = "vendor"


def cargo_features() -> list[str]:
    """The cargo features of the core: `ffi`, and `test-ops` where SDP4BIT_TEST_OPS=1."""
    test_ops = os.environ.get("SDP4BIT_TEST_OPS", "")
    if test_ops not in ("", "0", "1"):
        raise RuntimeError(f"sdp4bit: SDP4BIT_TEST_OPS={test_ops!r}; expected 1, 0 or unset")
    return ["ffi", "test-ops"] if test_ops == "1" else ["ffi"]


def cargo_build(features: list[str], repo: Path = REPO) -> tuple[Path, Path]:
    """Runs `cargo build --release --features FEATURES --lib`; returns (staticlib, cxxbridge
    include)."""
    cargo = os.environ.get("CARGO", "cargo")
    if shutil.which(cargo) is None:
        raise RuntimeError(
            "sdp4bit: building the Rust core needs cargo (https://rustup.rs); on a host "
            "without Rust, build a native bundle elsewhere with `python scripts/build_native.py "
            "--out DIR` and install with SDP4BIT_NATIVE_DIR=DIR"
        )
    command = [cargo, "build", "--release", "--locked", "--features", ",".join(features), "--lib",
               "--message-format=json-render-diagnostics", *vendored_sources(repo)]
    proc = subprocess.run(command, cwd=repo, stdout=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"sdp4bit: `{' '.join(command)}` failed (exit {proc.returncode})")
    staticlib = include = None
    for line in proc.stdout.splitlines():
        message = json.loads(line)
        package = message.get("package_id", "")
        if "sdp4bit" not in package:
            continue
        if message.get("reason") == "build-script-executed":
            include = Path(message["out_dir"]) / "cxxbridge" / "include"
        if message.get("reason") == "compiler-artifact" and message["target"]["name"] == "sdp4bit":
            staticlib = next(Path(f) for f in message["filenames"] if f.endswith(".a"))
    if staticlib is None or include is None:
        raise RuntimeError("sdp4bit: cargo did not report the static library and bridge headers")
    return staticlib, include


def vendored_sources(repo: Path) -> list[str]:
    """cargo's options that replace crates.io by the tree's vendor/ and forbid the network, when
    the tree has one (an unpacked sdist); none otherwise."""
    vendor = repo / VENDOR_DIR
    if not vendor.is_dir():
        return []
    return ["--offline", "--config", 'source.crates-io.replace-with="vendored-sources"',
            "--config", f"source.vendored-sources.directory={json.dumps(str(vendor))}"]


def vendor(repo: Path, out: Path) -> None:
    """Copies the sources of every crate Cargo.lock names into `out` (`cargo vendor`)."""
    cargo = os.environ.get("CARGO", "cargo")
    command = [cargo, "vendor", "--locked", "--versioned-dirs", "--quiet", str(out)]
    proc = subprocess.run(command, cwd=repo, stdout=subprocess.DEVNULL)
    if proc.returncode != 0:
        raise RuntimeError(f"sdp4bit: `{' '.join(command)}` failed (exit {proc.returncode})")


def stage(out: Path, repo: Path = REPO) -> Path:
    """Builds with cargo and writes a native bundle to `out`; returns `out`."""
    features = cargo_features()
    staticlib, include = cargo_build(features, repo)
    if out.exists():
        shutil.rmtree(out)
    (out / "lib").mkdir(parents=True)
    shutil.copy2(staticlib, out / "lib" / "libsdp4bit.a")
    for header in HEADERS:
        target = out / "include" / header
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(include / header, target)
    target = out / "include" / "sdp4bit" / "cpp" / "torch_comms.h"
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(repo / "cpp" / "torch_comms.h", target)
    (out / FEATURES_FILE).write_text("\n".join(features) + "\n")
    return out


def bundle_features(bundle: Path) -> list[str]:
    """The cargo features the bundle's core was built with."""
    return (bundle / FEATURES_FILE).read_text().split()


def check_bundle(bundle: Path) -> Path:
    """Raises unless `bundle` holds everything the extension build needs."""
    needed = [bundle / "lib" / "libsdp4bit.a", bundle / "include" / "sdp4bit" / "cpp" / "torch_comms.h"]
    needed += [bundle / "include" / h for h in HEADERS] + [bundle / FEATURES_FILE]
    missing = [str(p) for p in needed if not p.is_file()]
    if missing:
        raise RuntimeError(f"sdp4bit: native bundle {bundle} lacks {', '.join(missing)}")
    return bundle


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="directory to write the bundle to")
    args = parser.parse_args()
    print(check_bundle(stage(args.out.resolve())))
    return 0


if __name__ == "__main__":
    sys.exit(main())

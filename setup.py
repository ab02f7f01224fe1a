"""Builds sdp4bit: the torch extension `sdp4bit._sdp4bit` against the installed torch, or a
portable wheel; the sdist carries the crates (docs/install.md).

- `pip install .` (and an sdist): the Rust core is built with cargo (scripts/build_native.py),
  or taken prebuilt from SDP4BIT_NATIVE_DIR on hosts without a Rust toolchain, and the
  extension is compiled against the torch of the interpreter it installs into. Its objects are
  kept per torch ABI (build/temp.*/torch-<tag>), and an extension in build/ that records
  another torch ABI is rebuilt, never packaged again.
- SDP4BIT_PORTABLE_WHEEL=1 (scripts/build_wheel.py): no extension is compiled and torch is not
  needed; the package carries the prebuilt core and the extension's C++ sources in
  sdp4bit/_bundle/, compiled at first import against the installed torch (sdp4bit/_jit.py).
- An sdist vendors the crates (`cargo vendor` into vendor/), which build_native.py then uses
  instead of crates.io, so it builds offline.
"""

import hashlib
import importlib.util
import json
import os
import platform
import shutil
import sys
import sysconfig
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.sdist import sdist

REPO = Path(__file__).resolve().parent
PORTABLE = os.environ.get("SDP4BIT_PORTABLE_WHEEL") == "1"

#: The extension's C++ sources, compiled at install or, from a portable wheel, at first import.
EXTENSION_SOURCES = ["sdp4bit_ops.cpp", "torch_comms.cpp", "profiler_ranges.cpp"]


def load_by_path(name: str, path: Path):
    """A module of this tree, loaded from its file (the package itself imports torch)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


build_native = load_by_path("build_native", REPO / "scripts" / "build_native.py")
torch_abi = load_by_path("sdp4bit_torch_abi", REPO / "sdp4bit" / "_torch_abi.py")
glibc_floor = load_by_path("glibc_floor", REPO / "scripts" / "glibc_floor.py")


def native_bundle() -> Path:
    """The Rust core as a native bundle: prebuilt (SDP4BIT_NATIVE_DIR) or built with cargo."""
    prebuilt = os.environ.get("SDP4BIT_NATIVE_DIR")
    if prebuilt:
        return build_native.check_bundle(Path(prebuilt).resolve())
    return build_native.stage(REPO / "build" / "sdp4bit-native", REPO)


class VendoredSdist(sdist):
    """An sdist with the crates of Cargo.lock in vendor/ (`cargo vendor`)."""

    def make_release_tree(self, base_dir, files):
        super().make_release_tree(base_dir, files)
        build_native.vendor(REPO, Path(base_dir) / build_native.VENDOR_DIR)


def import_cpp_extension():
    """torch.utils.cpp_extension of the interpreter pip installs into.

    pip's isolated build environment hides site-packages; the extension must be compiled
    against the torch that will load it, so the target interpreter's site-packages is searched
    when the build environment has no torch of its own.
    """
    try:
        import torch  # noqa: F401
    except ImportError:
        for key in ("purelib", "platlib"):
            path = sysconfig.get_paths()[key]
            if path not in sys.path:
                sys.path.append(path)
        try:
            import torch  # noqa: F401
        except ImportError:
            sys.exit("sdp4bit: install torch first (pip install torch); the extension is built "
                     "against the installed torch")
    from torch.utils import cpp_extension

    return cpp_extension


def source_build():
    """The extension and the build_ext command of `pip install .`."""
    cpp_extension = import_cpp_extension()

    class BuildWithRustCore(cpp_extension.BuildExtension):
        """Builds (or finds) the Rust core first, then compiles the extension against it, and
        records beside it the torch it was compiled against (torch's C++ ABI changes between
        releases; the package refuses to load the extension under another torch ABI)."""

        def finalize_options(self):
            super().finalize_options()
            self.torch = torch_abi.installed()
            # Objects compiled against one torch are never linked for another; switching back
            # to a torch built for before reuses its objects (ninja rebuilds what changed).
            self.build_temp = os.path.join(self.build_temp,
                                           f"torch-{torch_abi.tag_of(self.torch)}")

        def build_extensions(self):
            bundle = native_bundle()
            test_ops = "test-ops" in build_native.bundle_features(bundle)
            for ext in self.extensions:
                ext.include_dirs.append(str(bundle / "include"))
                ext.extra_objects.append(str(bundle / "lib" / "libsdp4bit.a"))
                if test_ops:  # the tests' in-process references (scripts/build_native.py)
                    ext.define_macros.append(("SDP4BIT_TEST_OPS", None))
                built = Path(self.get_ext_fullpath(ext.name))
                # An extension built for another torch looks up to date to setuptools (its
                # sources are older): rebuild it rather than package it.
                if built.exists() and torch_abi.stale(built, self.torch):
                    self.force = True
            super().build_extensions()
            for ext in self.extensions:
                torch_abi.write_record(Path(self.get_ext_fullpath(ext.name)), self.torch)

    extension = cpp_extension.CppExtension(
        name="sdp4bit._sdp4bit",
        sources=[f"cpp/{s}" for s in EXTENSION_SOURCES],
        include_dirs=[str(REPO / "cpp")],
        # No -std flag: torch's BuildExtension adds the C++ standard the installed torch's
        # headers need (C++17 up to torch 2.14, C++20 from 2.15).
        extra_compile_args=["-O2"],
        libraries=["dl", "pthread", "m"],
    )
    return [extension], BuildWithRustCore.with_options(no_python_abi_suffix=True)


class BuildPyWithBundle(build_py):
    """Copies into the package, as sdp4bit/_bundle/, the prebuilt core and the extension's C++
    sources with a manifest (their list, the core's features and a digest of every file)."""

    def run(self):
        super().run()
        bundle = native_bundle()
        target = Path(self.build_lib) / "sdp4bit" / "_bundle"
        if target.exists():
            shutil.rmtree(target)
        shutil.copytree(bundle / "lib", target / "lib")
        shutil.copytree(bundle / "include", target / "include")
        shutil.copytree(REPO / "cpp", target / "cpp",
                        ignore=shutil.ignore_patterns("*.o", "__pycache__"))
        digest = hashlib.sha256()
        for path in sorted(p for p in target.rglob("*") if p.is_file()):
            digest.update(str(path.relative_to(target)).encode() + b"\0" + path.read_bytes())
        manifest = {"sources": EXTENSION_SOURCES, "features": build_native.bundle_features(bundle),
                    "digest": digest.hexdigest()}
        (target / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")


def portable_bdist_wheel():
    """bdist_wheel tagged py3-none-manylinux_X_Y_x86_64: no Python extension is inside (the
    glue is compiled at first import), so any Python 3 takes it, but the core is x86-64 Linux
    code, linked on the user's host against glibc X.Y or newer (scripts/glibc_floor.py: the
    newest glibc release among those that introduced a symbol the archive needs)."""
    from setuptools.command.bdist_wheel import bdist_wheel

    class PortableWheel(bdist_wheel):
        def get_tag(self):
            if platform.machine() != "x86_64" or platform.libc_ver()[0] != "glibc":
                sys.exit("sdp4bit: a portable wheel is built on x86-64 glibc Linux, not "
                         f"{platform.libc_ver()} on {platform.machine()}")
            staged = Path(self.get_finalized_command("build_py").build_lib)
            return "py3", "none", glibc_floor.platform_tag(
                staged / "sdp4bit" / "_bundle" / "lib" / "libsdp4bit.a")

    return PortableWheel


if PORTABLE:
    setup(cmdclass={"build_py": BuildPyWithBundle, "bdist_wheel": portable_bdist_wheel(),
                    "sdist": VendoredSdist})
elif "sdist" in sys.argv or "egg_info" in sys.argv:
    # Making an sdist (or its metadata) compiles nothing and needs no torch.
    setup(cmdclass={"sdist": VendoredSdist})
else:
    ext_modules, build_ext = source_build()
    setup(ext_modules=ext_modules, cmdclass={"build_ext": build_ext, "sdist": VendoredSdist})

"""Builds the torch extension `sdp4bit._sdp4bit` against the installed torch.

The Rust core is built with cargo when the extension is built (scripts/build_native.py), or
taken prebuilt from SDP4BIT_NATIVE_DIR on hosts without a Rust toolchain. See the README.
"""

import importlib.util
import os
import sys
import sysconfig
from pathlib import Path

from setuptools import setup

REPO = Path(__file__).resolve().parent


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


def load_build_native():
    """scripts/build_native.py as a module."""
    spec = importlib.util.spec_from_file_location("build_native",
                                                  REPO / "scripts" / "build_native.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


build_native = load_build_native()


def native_bundle() -> Path:
    """The Rust core as a native bundle: prebuilt (SDP4BIT_NATIVE_DIR) or built with cargo."""
    prebuilt = os.environ.get("SDP4BIT_NATIVE_DIR")
    if prebuilt:
        return build_native.check_bundle(Path(prebuilt).resolve())
    return build_native.stage(REPO / "build" / "sdp4bit-native", REPO)


cpp_extension = import_cpp_extension()


class BuildWithRustCore(cpp_extension.BuildExtension):
    """Builds (or finds) the Rust core first, then compiles the extension against it, and
    records beside it the torch version it was compiled against (torch's C++ ABI changes
    between releases; the package refuses to load the extension under another torch)."""

    def build_extensions(self):
        import torch

        bundle = native_bundle()
        test_ops = "test-ops" in build_native.bundle_features(bundle)
        for ext in self.extensions:
            ext.include_dirs.append(str(bundle / "include"))
            ext.extra_objects.append(str(bundle / "lib" / "libsdp4bit.a"))
            if test_ops:  # the tests' in-process references (scripts/build_native.py)
                ext.define_macros.append(("SDP4BIT_TEST_OPS", None))
        super().build_extensions()
        for ext in self.extensions:
            built = Path(self.get_ext_fullpath(ext.name))
            built.with_name(built.stem + ".torch-version").write_text(torch.__version__ + "\n")


setup(
    ext_modules=[
        cpp_extension.CppExtension(
            name="sdp4bit._sdp4bit",
            sources=["cpp/sdp4bit_ops.cpp", "cpp/torch_comms.cpp",
                     "cpp/profiler_ranges.cpp"],
            include_dirs=[str(REPO / "cpp")],
            # No -std flag: torch's BuildExtension adds the C++ standard the installed torch's
            # headers need (C++17 up to torch 2.14, C++20 from 2.15).
            extra_compile_args=["-O2"],
            libraries=["dl", "pthread", "m"],
        )
    ],
    cmdclass={"build_ext": BuildWithRustCore.with_options(no_python_abi_suffix=True)},
)

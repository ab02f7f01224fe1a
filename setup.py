"""Builds the torch extension `megatron_patch._sdp4bit` against the installed torch.

The Rust core is built with cargo (scripts/build_native.py), or taken prebuilt from
SDP4BIT_NATIVE_DIR on hosts without a Rust toolchain. See the README.
"""

import importlib.util
import os
import sys
import sysconfig
from pathlib import Path

from setuptools import setup

REPO = Path(__file__).resolve().parent


def import_torch():
    """The torch of the interpreter pip installs into.

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
    spec = importlib.util.spec_from_file_location("build_native", REPO / "scripts" / "build_native.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def native_bundle() -> Path:
    build_native = load_build_native()
    prebuilt = os.environ.get("SDP4BIT_NATIVE_DIR")
    if prebuilt:
        return build_native.check_bundle(Path(prebuilt).resolve())
    return build_native.stage(REPO / "build" / "sdp4bit-native", REPO)


cpp_extension = import_torch()
bundle = native_bundle()

setup(
    ext_modules=[
        cpp_extension.CppExtension(
            name="megatron_patch._sdp4bit",
            sources=["cpp/sdp4bit_ops.cpp", "cpp/torch_comms.cpp"],
            include_dirs=[str(bundle / "include"), str(REPO / "cpp")],
            extra_objects=[str(bundle / "lib" / "libsdp4bit.a")],
            extra_compile_args=["-O2", "-std=c++17"],
            libraries=["dl", "pthread", "m"],
            py_limited_api=False,
        )
    ],
    cmdclass={"build_ext": cpp_extension.BuildExtension.with_options(no_python_abi_suffix=True)},
)

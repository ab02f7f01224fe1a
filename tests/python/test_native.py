"""Loading the compiled extension: it refuses a torch whose C++ ABI (release, C++11 ABI flag)
differs from the one it was built against, but not another CUDA suffix; links only stable-ABI
Python functions; and holds the tests' in-process references only when built for the tests."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import sdp4bit
import torch
from sdp4bit import _torch_abi

ROOT = Path(__file__).resolve().parents[2]


def installed_library() -> Path:
    [library] = Path(sdp4bit.__file__).resolve().parent.glob("_sdp4bit*.so")
    return library


def test_extension_records_the_torch_it_was_built_against():
    built = _torch_abi.read_record(installed_library())
    assert built is not None and built["torch"] == torch.__version__
    assert _torch_abi.mismatch(built, _torch_abi.installed()) is None


def import_with_record(tmp_path: Path, record: dict) -> subprocess.CompletedProcess:
    """Imports a copy of the package whose extension records ``record``."""
    package = Path(sdp4bit.__file__).resolve().parent
    copy = tmp_path / package.name
    shutil.copytree(package, copy, ignore=shutil.ignore_patterns("__pycache__"))
    [library] = copy.glob("_sdp4bit*.so")
    _torch_abi.write_record(library, record)
    return subprocess.run([sys.executable, "-c", f"import {package.name}"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)


def test_extension_built_against_another_torch_release_or_abi_is_refused(tmp_path):
    running = _torch_abi.installed()
    for other in [{**running, "torch": "1.0.0"},
                  {**running, "cxx11_abi": not running["cxx11_abi"]}]:
        done = import_with_record(tmp_path / str(other["cxx11_abi"]), other)
        assert done.returncode != 0
        assert (f"was built against torch {other['torch']} ({_torch_abi.tag_of(other)}), but this "
                f"interpreter has torch {torch.__version__}" in done.stderr), done.stderr


def test_another_cuda_suffix_of_the_same_release_is_loaded(tmp_path):
    """The local part (+cu128 against +cu130) names the CUDA runtime, which the extension's C++
    does not include: only the release and the C++11 ABI flag are compared."""
    running = _torch_abi.installed()
    release = running["torch"].split("+")[0]
    done = import_with_record(tmp_path, {**running, "torch": f"{release}+cu999"})
    assert done.returncode == 0, done.stderr


def test_abi_tags_compare_release_and_abi_flag_not_the_local_suffix():
    assert _torch_abi.abi_tag("2.9.0a0+40ec155e58", True) == "2.9.0a0-cxx11abi1"
    assert _torch_abi.abi_tag("2.11.0+cu130", False) == "2.11.0-cxx11abi0"
    cu128 = {"torch": "2.11.0+cu128", "cxx11_abi": True}
    assert _torch_abi.mismatch(cu128, {"torch": "2.11.0+cu130", "cxx11_abi": True}) is None
    assert _torch_abi.mismatch(cu128, {"torch": "2.11.0", "cxx11_abi": True}) is None
    for other in [{"torch": "2.15.0+cu128", "cxx11_abi": True},
                  {"torch": "2.11.0+cu128", "cxx11_abi": False},
                  {"torch": "2.11.0a0+cu128", "cxx11_abi": True}]:
        assert _torch_abi.mismatch(cu128, other) is not None, other
    # A record of an earlier release holds the version alone: the flag is not compared.
    legacy = {"torch": "2.11.0+cu130", "cxx11_abi": None}
    assert _torch_abi.mismatch(legacy, {"torch": "2.11.0+cu128", "cxx11_abi": False}) is None
    with pytest.raises(ValueError, match="'cu130' is not a torch version"):
        _torch_abi.abi_tag("cu130", True)


def test_a_built_extension_is_stale_for_another_torch(tmp_path):
    """What setup.py asks of an extension found in build/ (setuptools finds it up to date by
    its sources' times): rebuilt when it records another torch ABI or nothing."""
    library = tmp_path / "_sdp4bit.so"
    library.write_bytes(b"")
    running = {"torch": "2.15.0+cu132", "cxx11_abi": True}
    assert _torch_abi.stale(library, running)  # no record: an earlier build's, unknown
    _torch_abi.write_record(library, {"torch": "2.9.1+cu128", "cxx11_abi": True})
    assert _torch_abi.stale(library, running)
    _torch_abi.write_record(library, {"torch": "2.15.0+cu128", "cxx11_abi": True})
    assert not _torch_abi.stale(library, running)
    # An earlier release's record: loaded at import, but a build found with it is rebuilt (that
    # release wrote the torch it installed for over an extension it had not rebuilt).
    (tmp_path / "_sdp4bit.torch-version").write_text("2.15.0+cu128\n")
    assert _torch_abi.read_record(library) == {"torch": "2.15.0+cu128", "cxx11_abi": None}
    assert _torch_abi.mismatch(_torch_abi.read_record(library), running) is None
    assert _torch_abi.stale(library, running)


#: The Python C API functions the extension may link: all in the stable ABI (PEP 384), which
#: every CPython 3 minor version exports, so the same build loads under 3.11 and 3.12 (the GPU
#: hosts' Python) with the same torch. The rest it looks up at run time.
STABLE_ABI_FUNCTIONS = {"PyEval_RestoreThread", "PyEval_SaveThread", "PyGILState_Check",
                        "Py_IsInitialized"}


def python_symbols(library: Path) -> set[str]:
    """The Python C API symbols `library` leaves to the interpreter (nm -D)."""
    done = subprocess.run(["nm", "-D", "--undefined-only", str(library)], capture_output=True,
                          text=True, check=True)
    return {line.split()[-1] for line in done.stdout.splitlines()
            if line.split()[-1].startswith(("Py", "_Py"))}


def test_extension_links_only_stable_abi_python_functions():
    needed = python_symbols(installed_library())
    assert needed, "nm found no Python symbols at all: the check would see nothing"
    assert needed <= STABLE_ABI_FUNCTIONS, sorted(needed - STABLE_ABI_FUNCTIONS)


def test_only_a_build_for_the_tests_has_the_in_process_references(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import build_native
    monkeypatch.delenv("SDP4BIT_TEST_OPS", raising=False)
    assert build_native.cargo_features() == ["ffi"]
    monkeypatch.setenv("SDP4BIT_TEST_OPS", "0")
    assert build_native.cargo_features() == ["ffi"]
    monkeypatch.setenv("SDP4BIT_TEST_OPS", "1")
    assert build_native.cargo_features() == ["ffi", "test-ops"]
    monkeypatch.setenv("SDP4BIT_TEST_OPS", "yes")
    with pytest.raises(RuntimeError, match="SDP4BIT_TEST_OPS='yes'"):
        build_native.cargo_features()
    # This test run's extension was built for the tests, and says so through its ops.
    assert hasattr(torch.ops.sdp4bit, "simulate_grad_reduce_scatter")

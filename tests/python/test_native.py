"""Loading the compiled extension: it refuses a torch other than the one it was built against,
links only stable-ABI Python functions, and holds the tests' in-process references only when
built for the tests."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import sdp4bit
import torch

ROOT = Path(__file__).resolve().parents[2]


def test_extension_records_the_torch_it_was_built_against():
    package = Path(sdp4bit.__file__).resolve().parent
    recorded = [p.read_text().strip() for p in package.glob("_sdp4bit*.torch-version")]
    assert recorded == [torch.__version__]


def test_extension_built_against_another_torch_is_refused(tmp_path):
    package = Path(sdp4bit.__file__).resolve().parent
    copy = tmp_path / package.name
    shutil.copytree(package, copy, ignore=shutil.ignore_patterns("__pycache__"))
    next(copy.glob("_sdp4bit*.torch-version")).write_text("1.0.0\n")
    done = subprocess.run([sys.executable, "-c", f"import {package.name}"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert (f"was built against torch 1.0.0, but this interpreter has torch {torch.__version__}"
            in done.stderr), done.stderr


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
    [library] = Path(sdp4bit.__file__).resolve().parent.glob("_sdp4bit*.so")
    needed = python_symbols(library)
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

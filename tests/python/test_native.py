"""Loading the compiled extension: it refuses a torch other than the one it was built against."""

import shutil
import subprocess
import sys
from pathlib import Path

import sdp4bit
import torch


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

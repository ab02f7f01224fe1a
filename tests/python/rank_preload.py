"""Imported once by the fork server that starts the tests' rank processes (see harness.py):
the heavy libraries every rank would otherwise import again. A library that is not installed
is skipped; nothing here runs torch, Rust or collective code."""

import os
import sys

# The fork server runs as `python -c`, so its path starts with the working directory; from the
# repository's root that would shadow the installed package (the one under test, with its
# compiled extension) with the source tree's.
sys.path[:] = [p for p in sys.path if p not in ("", os.getcwd())]

# DeepSpeed fixes its accelerator when it is first used; the DeepSpeed tests run on CPU.
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402,F401
import torch.distributed  # noqa: E402,F401
import torch.distributed.fsdp  # noqa: E402,F401

try:
    import megatron.core.distributed  # noqa: F401
    import megatron.core.transformer  # noqa: F401
except ImportError:
    pass

try:
    import deepspeed  # noqa: F401
except ImportError:
    pass

import sdp4bit  # noqa: E402,F401  (loads the extension)

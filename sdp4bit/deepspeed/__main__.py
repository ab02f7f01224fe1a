"""``python -m sdp4bit.deepspeed SCRIPT [ARGS...]``: runs SCRIPT as ``__main__`` with
``deepspeed.initialize`` applying the config's ``"sdp4bit"`` section
(:func:`sdp4bit.deepspeed.install`), for scripts and libraries that call DeepSpeed themselves
(Hugging Face Trainer, Accelerate). Under a launcher: ``deepspeed --module sdp4bit.deepspeed
SCRIPT ...`` or ``torchrun ... -m sdp4bit.deepspeed SCRIPT ...``."""

from __future__ import annotations

import sys

from .._launch import run_script
from . import install

if __name__ == "__main__":
    run_script("sdp4bit.deepspeed", __doc__, sys.argv[1:], install)

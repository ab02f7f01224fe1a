"""``python -m sdp4bit.deepspeed SCRIPT [ARGS...]``: runs SCRIPT as ``__main__`` with
``deepspeed.initialize`` applying the config's ``"sdp4bit"`` section
(:func:`sdp4bit.deepspeed.install`), for scripts and libraries that call DeepSpeed themselves
(Hugging Face Trainer, Accelerate). Under a launcher: ``deepspeed --module sdp4bit.deepspeed
SCRIPT ...`` or ``torchrun ... -m sdp4bit.deepspeed SCRIPT ...``."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

from . import install


def main(argv: list[str]) -> None:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        raise SystemExit(0 if argv else 2)
    script = Path(argv[0])
    if not script.is_file():
        raise SystemExit(f"sdp4bit.deepspeed: no training script {argv[0]!r}")
    install()
    sys.path.insert(0, str(script.resolve().parent))  # as `python SCRIPT` has it
    sys.argv = list(argv)
    runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])

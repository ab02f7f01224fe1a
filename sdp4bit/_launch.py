"""Running an unmodified training script as ``__main__`` after a set-up, as ``python SCRIPT``
runs it: what the launcher prefixes ``python -m megatron_patch`` and ``python -m
sdp4bit.deepspeed`` share."""

from __future__ import annotations

import runpy
import sys
from collections.abc import Callable
from pathlib import Path


def run_script(prog: str, usage: str, argv: list[str], set_up: Callable[[], None]) -> None:
    """Runs ``argv[0]`` with ``argv`` as its ``sys.argv`` and its directory first on
    ``sys.path`` (as ``python SCRIPT`` has it, so the checkout the script lives in provides its
    packages from any working directory), after `set_up`. Without a script, or with ``-h``,
    prints `usage`; a missing script stops with one line naming `prog`."""
    if not argv or argv[0] in ("-h", "--help"):
        print(usage)
        raise SystemExit(0 if argv else 2)
    script = Path(argv[0])
    if not script.is_file():
        raise SystemExit(f"{prog}: no training script {argv[0]!r}")
    sys.path.insert(0, str(script.resolve().parent))
    set_up()
    sys.argv = list(argv)
    runpy.run_path(argv[0], run_name="__main__")

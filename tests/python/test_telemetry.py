"""Where sdp4bit's start-up line and telemetry reports appear (sdp4bit.telemetry.announce)."""

import os
import subprocess
import sys

import pytest

#: Each case: (logging set-up before the line, the launcher's variables (before any process
#: group exists), where the line must appear: "stdout", "stderr" or None for nowhere).
CASES = {
    "nothing configured: printed, as Megatron's print_rank_0": ("", {}, "stdout"),
    "INFO configured: logged": ("logging.basicConfig(level=logging.INFO)", {}, "stderr"),
    "root at WARNING (Python's default, set explicitly): printed": (
        "logging.basicConfig(level=logging.WARNING)", {}, "stdout"),
    "sdp4bit's logger set to WARNING: silenced": (
        "logging.getLogger('sdp4bit').setLevel(logging.WARNING)", {}, None),
    "torchrun's rank 0: printed": ("", {"RANK": "0"}, "stdout"),
    "torchrun's rank 1: not shown": ("", {"RANK": "1"}, None),
    "srun's task 1: not shown": ("", {"SLURM_PROCID": "1"}, None),
}
LAUNCHER_VARIABLES = ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK")

LINE = "sdp4bit enabled: the line under test"


@pytest.mark.parametrize("case", CASES)
def test_the_line_is_seen_unless_silenced(case):
    set_up, launcher, where = CASES[case]
    script = (f"import logging\n{set_up}\nfrom sdp4bit.telemetry import announce\n"
              f"announce({LINE!r})\n")
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    done = subprocess.run([sys.executable, "-c", script], cwd="/", capture_output=True,
                          text=True, timeout=300, env={**env, **launcher})
    assert done.returncode == 0, done.stderr
    found = {name: LINE in text for name, text in (("stdout", done.stdout),
                                                   ("stderr", done.stderr))}
    assert found == {name: name == where for name in found}, (done.stdout, done.stderr)

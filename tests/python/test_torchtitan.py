"""The torchtitan recipe (docs/fsdp.md, "torchtitan"): examples/torchtitan/train.py on 4 gloo
ranks as dp 2 x tp 2, checkpointed with DCP and resumed in fresh processes."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples/torchtitan/train.py"


def _run(tmp_path: Path, folder: Path, out: Path) -> tuple[dict, str]:
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
         str(SCRIPT), "--tp", "2", "--steps", "4", "--checkpoint-folder", str(folder),
         "--checkpoint-interval", "2", "--json-out", str(out)],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"})
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    return json.loads(out.read_text()), done.stdout


def test_the_torchtitan_recipe_trains_checkpoints_and_resumes_bit_for_bit(tmp_path):
    straight, log = _run(tmp_path, tmp_path / "run", tmp_path / "straight.json")
    assert straight["resumed_from"] is None and len(straight["losses"]) == 4
    lines = [line for line in log.splitlines() if line.startswith("step:")]
    assert len(lines) == 4 and all("loss:" in line and "wire:" in line for line in lines)
    sent, uncompressed = map(float, re.search(r"wire: ([\d.]+) MiB of ([\d.]+) MiB",
                                              lines[-1]).groups())
    assert 0 < sent < uncompressed
    assert straight["losses"][-1] < straight["losses"][0]
    # Fresh processes from the step-2 checkpoint end with the same parameters, bit for bit.
    shutil.copytree(tmp_path / "run" / "step-2", tmp_path / "resume" / "step-2")
    resumed, _ = _run(tmp_path, tmp_path / "resume", tmp_path / "resumed.json")
    assert resumed["resumed_from"] == "step-2"
    assert resumed["losses"] == straight["losses"][2:]
    assert resumed["digest"] == straight["digest"]

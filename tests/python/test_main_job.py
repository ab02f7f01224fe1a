"""The main job (examples/gpt_cpu/train.py) runs end to end: 4 ranks, a few steps."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_main_job_trains_and_reports_bytes_saved(tmp_path):
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "4", str(ROOT / "examples/gpt_cpu/train.py"),
               "--ranks-per-node", "2", "--steps", "6", "--log-every", "5",
               "--corpus-bytes", "400000"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300,
                          cwd=tmp_path)  # not the repository: its megatron_patch has no extension
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout}\n{done.stderr[-4000:]}"
    out = done.stdout
    assert "replicas bit-identical: True" in out, out
    assert "x less" in out and "MiB saved" in out, out
    losses = [float(line.split()[1]) for line in out.splitlines()
              if line.strip() and line.split()[0].isdigit()]
    assert losses[-1] < losses[0], out

"""The main job, as the README runs it (bash scripts/main_job.sh), end to end: megatron-core's
GPTModel and DistributedOptimizer on 4 ranks, a few steps."""

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_main_job_trains_and_reports_bytes_saved(tmp_path):
    command = ["bash", str(ROOT / "scripts/main_job.sh"), "--steps", "6", "--log-every", "5",
               "--corpus-bytes", "400000"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout}\n{done.stderr[-4000:]}"
    out = done.stdout
    assert "megatron-core GPTModel" in out and "DistributedOptimizer" in out, out
    assert "skipped steps 0; replicas bit-identical: True" in out, out
    assert "x less" in out and "MiB saved" in out, out
    losses = [float(line.split()[1]) for line in out.splitlines()
              if line.strip() and line.split()[0].isdigit()]
    assert losses[-1] < losses[0], out

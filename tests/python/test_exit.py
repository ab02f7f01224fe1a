"""Process exit with sdp4bit's collectives still in flight: no rank aborts."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from harness import free_port

HERE = Path(__file__).resolve().parent


# Rank 0's interpreter shutdown takes a few hundred milliseconds; these delays make the
# collective complete before, during and after it (before the exit hook, every delay from
# 0.25 s to 0.6 s aborted rank 0 with "terminate called without an active exception").
@pytest.mark.parametrize("delay", [0.0, 0.3, 0.6])
def test_exit_while_a_thread_waits_on_a_collective(tmp_path, delay):
    port = free_port()
    flag = tmp_path / "rank0-exiting"
    procs = []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen(
            [sys.executable, str(HERE / "exit_rank.py"), str(flag), str(delay)], env=env,
            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    for rank, proc in enumerate(procs):
        out, _ = proc.communicate(timeout=120)
        assert "terminate called" not in out, f"rank {rank}:\n{out[-3000:]}"
        assert proc.returncode == 0, f"rank {rank} exited with {proc.returncode}:\n{out[-3000:]}"

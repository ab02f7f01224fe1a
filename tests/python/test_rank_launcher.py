"""megatron_on_cpu/rank_launcher.py, which forks the convergence study's ranks from a launcher that
imported the heavy libraries once: each rank sees torchrun's rendezvous variables and runs the
script as ``__main__``; a failing rank stops the others and its status is the run's; a run
past its time is stopped; the launcher refuses to fork once it has a second thread.

Each case runs the launcher in a fresh interpreter (the test process has threads of its own)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

MEGATRON_ON_CPU = Path(__file__).resolve().parents[2] / "megatron_on_cpu"

DRIVER = """
import json, sys, threading, time
from pathlib import Path
sys.path.insert(0, {megatron_on_cpu!r})
from rank_launcher import RankLauncher

launcher = RankLauncher({{"OMP_NUM_THREADS": "1", "SDP4BIT_LAUNCHER_TEST": "inherited"}},
                        preload=("torch",))
if {with_thread!r}:
    threading.Thread(target=time.sleep, args=(5,), daemon=True).start()
try:
    done = launcher.run(Path({script!r}), {args!r}, {world}, Path({cwd!r}), {timeout})
except RuntimeError as e:
    print(json.dumps({{"refused": str(e)}}))
else:
    print(json.dumps({{"returncode": done.returncode, "output": done.output}}))
"""


def launch(tmp_path: Path, body: str, world: int = 2, args: tuple[str, ...] = (),
           timeout: float = 60, with_thread: bool = False) -> dict:
    script = tmp_path / "scripts" / "job.py"
    script.parent.mkdir(exist_ok=True)
    script.write_text(textwrap.dedent(body))
    driver = DRIVER.format(megatron_on_cpu=str(MEGATRON_ON_CPU), script=str(script), args=list(args),
                           world=world, cwd=str(tmp_path), timeout=timeout,
                           with_thread=with_thread)
    done = subprocess.run([sys.executable, "-c", driver], capture_output=True, text=True,
                          timeout=timeout + 120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def test_ranks_rendezvous_as_under_torchrun_and_run_the_script_as_main(tmp_path):
    result = launch(tmp_path, """
        import atexit, json, os, sys
        from pathlib import Path
        import torch
        import torch.distributed as dist
        dist.init_process_group("gloo")
        total = torch.tensor([dist.get_rank() + 1.0])
        dist.all_reduce(total)
        dist.destroy_process_group()
        keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                "SDP4BIT_LAUNCHER_TEST")
        seen = {"env": {k: os.environ.get(k) for k in keys}, "argv": sys.argv[1:],
                "cwd": os.getcwd(), "path0": sys.path[0], "name": __name__,
                "sum": total.item()}
        rank = os.environ["RANK"]
        atexit.register(lambda: Path(f"exit{rank}").write_text("ran"))
        Path(f"rank{rank}.json").write_text(json.dumps(seen))
        print("hello from", rank)
    """, world=3, args=("--flag", "value"))
    assert result["returncode"] == 0, result["output"]
    for rank in range(3):
        seen = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert seen["env"] == {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "3",
                               "LOCAL_WORLD_SIZE": "3", "GROUP_RANK": "0",
                               "SDP4BIT_LAUNCHER_TEST": "inherited"}
        assert seen["argv"] == ["--flag", "value"]
        assert seen["cwd"] == str(tmp_path)
        assert seen["path0"] == str(tmp_path / "scripts")
        assert seen["name"] == "__main__"
        assert seen["sum"] == 6.0
        assert (tmp_path / f"exit{rank}").read_text() == "ran"
        assert f"--- rank {rank} ---\nhello from {rank}\n" in result["output"]


def test_a_failing_rank_stops_the_others_and_gives_the_run_its_status(tmp_path):
    start = time.monotonic()
    result = launch(tmp_path, """
        import os, sys, time
        if os.environ["RANK"] == "1":
            print("rank 1 gives up")
            sys.exit(3)
        time.sleep(600)  # as a rank waiting in a collective for its peer
    """, timeout=300)
    assert result["returncode"] == 3
    assert "rank 1 gives up" in result["output"]
    assert time.monotonic() - start < 120


@pytest.mark.parametrize("body, status, shown", [
    ('raise SystemExit("replicas differ")', 1, "replicas differ"),
    ('raise ValueError("bad batch")', 1, "ValueError: bad batch"),
    ("import os; os.kill(os.getpid(), 9)", 137, ""),
])
def test_a_rank_that_raises_or_dies_fails_the_run(tmp_path, body, status, shown):
    result = launch(tmp_path, body)
    assert result["returncode"] == status
    assert shown in result["output"]


def test_a_run_past_its_time_is_stopped(tmp_path):
    start = time.monotonic()
    result = launch(tmp_path, "import time; time.sleep(600)", timeout=2)
    assert result["returncode"] == 124
    assert time.monotonic() - start < 120


def test_the_launcher_refuses_to_fork_with_a_second_thread(tmp_path):
    # A Python thread here; an OpenMP pool (torch imported without OMP_NUM_THREADS=1) alike.
    result = launch(tmp_path, "pass", with_thread=True)
    assert "the launcher has 2 threads" in result["refused"]

"""A rank dies in the middle of sdp4bit's compressed collective, in each integration
(megatron-core's DDP with the distributed optimizer, DeepSpeed ZeRO 2, FSDP2): every other
rank fails within the process group's timeout, with an error naming sdp4bit's collective, and
no rank hangs (the runner enforces a wall-clock limit)."""

from __future__ import annotations

import time

import pytest
import torch.multiprocessing as mp
from harness import free_port

import fault_scenarios
from fault_scenarios import DEATH_STATUS, DYING_RANK, TIMEOUT_S

WORLD = 2
#: Set-up (imports are preloaded), a few steps, the failure and every exit: what a rank that
#: has not exited by then is taken to hang in (a minute at most here, on 2 overloaded cores).
WALL_LIMIT_S = 120


def run_with_a_dying_rank(tmp_path, integration: str, collective: str | None = None,
                          call: int = 0, wall_limit_s: float = WALL_LIMIT_S,
                          named: bool = True) -> dict:
    """Runs `integration` on WORLD ranks, :data:`DYING_RANK` dying as it enters its `call`-th
    start of the sdp4bit `collective` class (None: no rank dies; `named` False: the control
    without collective names, fault_scenarios.rank_entry). Waits for every rank to exit; past
    `wall_limit_s` kills them all and raises TimeoutError naming those still running.
    Returns {"reports": [each rank's fault_scenarios.report], "exit_codes", "death_at"}."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["rank_preload"])
    port = free_port()
    env = {"LOCAL_WORLD_SIZE": str(WORLD), "DS_ACCELERATOR": "cpu"}
    procs = [ctx.Process(target=fault_scenarios.rank_entry,
                         args=(r, WORLD, port, env, integration, collective, call, str(tmp_path),
                               named))
             for r in range(WORLD)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + wall_limit_s
    try:
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        running = [r for r, p in enumerate(procs) if p.is_alive()]
        if running:
            raise TimeoutError(f"ranks {running} still running after {wall_limit_s} s")
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    return {"reports": [fault_scenarios.report(str(tmp_path), r) for r in range(WORLD)],
            "exit_codes": [p.exitcode for p in procs],
            "death_at": fault_scenarios.death_time(str(tmp_path))}


def peer_errors(run: dict) -> list[dict]:
    """The errors the ranks other than the dying one raised, after checking that the dying
    rank died where it was told to and that each other rank raised sdp4bit's error within the
    process group's timeout of the death, then exited."""
    assert run["exit_codes"][DYING_RANK] == DEATH_STATUS, run
    assert run["death_at"] is not None, "the dying rank did not reach the collective"
    errors = []
    for rank in range(WORLD):
        if rank == DYING_RANK:
            continue
        status, error = run["reports"][rank]
        assert status == "error", f"rank {rank} went on as if nothing happened: {error}"
        assert error["type"] == "Sdp4bitError", error["traceback"]
        assert error["at"] - run["death_at"] < TIMEOUT_S, (error["at"] - run["death_at"])
        assert run["exit_codes"][rank] == 0, run["exit_codes"]
        errors.append(error)
    return errors


@pytest.mark.parametrize("integration, collective, call, named", [
    # The all-gather after the first update (qWD's first), the reduce-scatter of the second
    # step, the first reduce-scatter of the second step (three FSDP units).
    ("megatron", "WeightAllGather", 1, "parameter all-gather of bucket 0 at step 0"),
    ("deepspeed", "GradReduceScatter", 2, "gradient reduce-scatter of bucket 0 at step 1"),
    ("fsdp", "GradReduceScatter", 4, "gradient reduce-scatter of bucket"),
])
def test_a_rank_dying_mid_collective_fails_the_others_promptly(tmp_path, integration,
                                                               collective, call, named):
    errors = peer_errors(run_with_a_dying_rank(tmp_path, integration, collective, call))
    for error in errors:
        assert f"in sdp4bit's {named}" in error["message"], error["message"]


def test_without_the_collectives_name_the_error_does_not_say_where(tmp_path):
    # Control: the same death with the errors as they were before they named the collective;
    # the check above would fail on them.
    for error in peer_errors(run_with_a_dying_rank(tmp_path, "fsdp", "GradReduceScatter", 4,
                                                   named=False)):
        assert "collective failed" in error["message"], error["message"]
        assert "in sdp4bit's" not in error["message"], error["message"]


def test_the_runner_stops_a_rank_that_hangs(tmp_path):
    # Control: rank 0 never returns; the runner kills it at the wall-clock limit and says so
    # (rank 1 may still be starting on a busy machine).
    started = time.monotonic()
    with pytest.raises(TimeoutError, match=r"ranks \[0(, 1)?\] still running after 5 s"):
        run_with_a_dying_rank(tmp_path, "stall", wall_limit_s=5)
    assert time.monotonic() - started < 60

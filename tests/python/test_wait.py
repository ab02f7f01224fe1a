"""Handle.wait on CPU collectives: it blocks on the collective's completion descriptor, returns
when the collective completes, raises its error, and leaves no descriptor behind."""

import wait_scenarios
from harness import run_ranks

DELAY_S = 1.5


def test_wait_blocks_until_completion_and_returns_promptly():
    rank0, rank1 = run_ranks(2, wait_scenarios.wait_returns_when_the_collective_completes,
                             DELAY_S)
    # The descriptor becomes readable only once the collective has completed, which rank 1,
    # still sleeping, has not let it do yet.
    assert not rank0["completed_at_start"] and not rank0["readable_at_start"], rank0
    assert rank0["completed_at_end"], rank0
    assert rank0["shard_right"], rank0
    # Rank 0 blocked until rank 1 joined, and returned when the collective completed: the two
    # ranks' wait() return within a scheduling delay of each other (a missed wake-up would
    # make rank 0 a minute late).
    assert rank0["done"] - rank0["started"] >= 0.9 * DELAY_S, rank0
    assert abs(rank0["done"] - rank1["done"]) < 0.5, (rank0, rank1)
    # Blocking costs the waiting thread no CPU per unit of time waited (polling every 1 ms
    # for 1.5 s took tens of ms).
    assert rank0["wait_cpu_s"] < 0.01, rank0
    # poll(), not select(): a descriptor numbered above FD_SETSIZE works.
    if rank0["held"]:
        assert rank0["fd"] > 1024, rank0


def test_completion_descriptors_do_not_leak():
    for rank, counts in enumerate(
            run_ranks(2, wait_scenarios.completion_descriptors_do_not_leak, 200)):
        before = counts["before"]
        # One per collective in flight.
        assert counts["while_in_flight"] == before + counts["in_flight"], (rank, counts)
        # After 600 collectives, at most the last one's: the executor thread lets go of a
        # descriptor just after it signals it, so wait() can return a moment before.
        assert counts["after_calls"] <= before + 1, (rank, counts)
        # None once the executor thread has been joined.
        assert counts["after_close"] == before, (rank, counts)


def test_errors_of_the_collective_are_raised_by_wait():
    rank0, _ = run_ranks(2, wait_scenarios.errors_from_the_collective_reach_wait)
    assert rank0["message"] is not None, "wait() returned without the exchange's error"
    # Sdp4bitError's message (the extension's "sdp4bit: " prefix taken off) names the exchange
    # and carries gloo's reason.
    assert rank0["message"].startswith("collective failed: all_to_all"), rank0
    assert "Timed out" in rank0["message"], rank0
    # Raised when the exchange timed out (2 s), not at a later completion check.
    assert 1.5 < rank0["seconds"] < 10, rank0
    # A second wait() raises the same error.
    assert rank0["again"] == rank0["message"], rank0

"""Resuming DeepSpeed ZeRO 1, 2 and 3 with sdp4bit through DeepSpeed's own checkpoints, and
weights written outside the optimizer step (CPU, gloo, 2 ranks, bf16)."""

from __future__ import annotations

import pytest
import torch

import deepspeed_resume_scenarios as rs
from harness import run_ranks

CPU = {"DS_ACCELERATOR": "cpu"}
# qWD weights and TLq-HS gradients on ZeRO 1/2; ZeRO 3 (no previous weights kept) with QSDP.
SECTIONS = {1: {"preset": "sdp4bit", "ranks_per_node": 1},
            2: {"preset": "sdp4bit", "ranks_per_node": 1},
            3: {"preset": "qsdp", "ranks_per_node": 1}}
BEFORE, AFTER = 2, 2  # steps before the checkpoint and after it


def _weights(per_rank) -> list[torch.Tensor]:
    return [torch.frombuffer(bytearray(weights), dtype=torch.int32) for _, weights in per_rank]


def _differs(per_rank, reference) -> bool:
    return any(not torch.equal(a, b) for a, b in zip(_weights(per_rank), reference))


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_resumed_run_continues_bit_identically(stage, tmp_path):
    # BEFORE + AFTER steps in one run (saving after BEFORE), against fresh processes that build
    # the engine from another initial seed, load the checkpoint and train AFTER steps: the
    # same bf16 model and fp32 master bits on every rank, replicas identical at every step.
    section, directory = SECTIONS[stage], str(tmp_path)
    whole = run_ranks(2, rs.resumable, stage, section, 11, BEFORE + AFTER, BEFORE, directory,
                      env=CPU)
    resumed = run_ranks(2, rs.resumable, stage, section, 22, AFTER, None, directory, True,
                        env=CPU)
    reference = _weights(whole)
    for (whole_identical, _), (resumed_identical, _) in zip(whole, resumed):
        assert all(whole_identical) and all(resumed_identical)
    for mine, theirs in zip(_weights(resumed), reference):
        assert torch.equal(mine, theirs), "the resumed run differs from the uninterrupted one"
    if stage == 1:
        return
    # The control: without the saved step counters the continuation differs.
    dropped = run_ranks(2, rs.resumable, stage, section, 22, AFTER, None, directory, True, 0,
                        "counters", env=CPU)
    assert _differs(dropped, reference), "the test does not see the counters"
    if stage == 3:
        return
    # The defect the test catches: sdp4bit as it was, qWD's references stale after the load
    # (taken from the other seed's weights at attach): the replicas drift apart.
    stale = run_ranks(2, rs.resumable, stage, section, 22, AFTER, None, directory, True, 0,
                      "references", env=CPU)
    assert not all(stale[0][0]), "stale references should make the replicas differ"


def test_best_model_reload_mid_run_continues_as_the_checkpoint_would(tmp_path):
    # As the Trainer's _load_best_model: the same process trains on, then loads an earlier
    # checkpoint; AFTER steps later its weights equal the uninterrupted run's from that point.
    section, directory = SECTIONS[2], str(tmp_path)
    whole = run_ranks(2, rs.resumable, 2, section, 11, BEFORE + AFTER, BEFORE, directory,
                      env=CPU)
    reloaded = run_ranks(2, rs.resumable, 2, section, 22, AFTER, None, directory, True, 3,
                         env=CPU)
    assert all(all(identical) for identical, _ in reloaded)
    for mine, theirs in zip(_weights(reloaded), _weights(whole)):
        assert torch.equal(mine, theirs)


def test_weights_written_outside_the_step_keep_the_replicas_identical():
    # load_state_dict on every rank, then an in-place write on rank 0 alone: each is seen
    # before the next compressed all-gather, which runs exact on every rank; a write through
    # .data (not seen) followed by resynchronize() keeps them identical too.
    for identical, resyncs in run_ranks(2, rs.written_outside_the_step, env=CPU):
        assert identical == [True, True, True, True]
        assert resyncs == 2
    # The control: not looked for, the stale references make the replicas differ.
    for identical, resyncs in run_ranks(2, rs.written_outside_the_step, False, env=CPU):
        assert identical[0] and not all(identical[1:]), identical
        assert resyncs == 0

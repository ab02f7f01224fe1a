"""Resuming FSDP2 training with sdp4bit through torch.distributed.checkpoint (DCP), and weights
loaded between steps: W = 4 as replicate 2 x shard 2 on gloo, sdp4bit's default preset."""

from __future__ import annotations

import pytest
import torch

import fsdp_resume_scenarios as rs
import sdp4bit.fsdp
from harness import run_ranks
from sdp4bit import Sdp4bitError
from sdp4bit.fsdp._torch import Unit


def _equal(a: list, b: list) -> bool:
    """Whether two ranks' lists of parameters (numpy arrays) are equal, torch.equal on each."""
    return len(a) == len(b) and all(torch.equal(torch.from_numpy(x), torch.from_numpy(y))
                                    for x, y in zip(a, b))


def test_a_run_resumed_from_dcp_continues_bit_identical_to_one_never_stopped(tmp_path):
    # 2 steps, dcp.save with sdp4bit's Stateful beside the model and optimizer, 2 more; fresh
    # processes build the model from another seed, dcp.load, and train the last 2 steps.
    path = str(tmp_path / "checkpoint")
    first = run_ranks(4, rs.uninterrupted, path, 2, 4)
    second = run_ranks(4, rs.resumed, path, 2, 4)
    for (saved, final, identical), (loaded, resumed, resumed_identical, control, missing) in zip(
            first, second):
        assert _equal(loaded, saved)
        assert _equal(resumed, final)
        assert all(identical) and all(resumed_identical), (identical, resumed_identical)
        # The control: the same load without sdp4bit's state restarts its random streams.
        assert not _equal(control, final)
        # A checkpoint saved without sdp4bit's state: DCP names the missing keys.
        assert "Missing key in checkpoint state_dict: sdp4bit.next_sync." in (missing or ""), \
            missing


def test_weights_loaded_between_steps_keep_replicas_identical():
    # FSDP's weight codecs keep no reference to earlier weights, so a model.load_state_dict
    # between steps needs nothing of sdp4bit: the replicas stay identical, and training goes
    # on exactly as from the loaded weights with sdp4bit's state at the load.
    for (before, after_load, source, final, identical, continued, control) in run_ranks(
            4, rs.loaded_between_steps, 2, 2):
        assert _equal(after_load, source) and not _equal(after_load, before)
        assert all(identical), identical
        assert _equal(final, continued)
        assert not _equal(final, control)  # the control: the comparison sees the streams


class _Syncs:
    """A unit's sync counter, as comms.UnitState holds it."""

    def __init__(self, next_sync):
        self.next_sync = next_sync


def test_the_state_holds_each_units_next_sync_and_refuses_another_models():
    units = [(Unit(name, None, None), _Syncs(0), None) for name in ("blocks.0", "")]
    state = sdp4bit.fsdp.State(None, units)
    assert state.state_dict() == {"next_sync": {"blocks.0": 0, "(root)": 0}}
    state.load_state_dict({"next_sync": {"blocks.0": 5, "(root)": 6}})
    assert [syncs.next_sync for _, syncs, _ in units] == [5, 6]
    with pytest.raises(Sdp4bitError, match=r"FSDP units \['\(root\)', 'blocks.1'\], this "
                                           r"model has units \['blocks.0', '\(root\)'\]"):
        state.load_state_dict({"next_sync": {"blocks.1": 5, "(root)": 6}})
    with pytest.raises(Sdp4bitError, match="the root FSDP unit's next gradient sync is -1"):
        state.load_state_dict({"next_sync": {"blocks.0": 7, "(root)": -1}})
    assert [syncs.next_sync for _, syncs, _ in units] == [5, 6]  # nothing half-loaded
    with pytest.raises(Sdp4bitError, match="sdp4bit is not enabled on this model"):
        sdp4bit.fsdp.stateful(torch.nn.Linear(2, 2))

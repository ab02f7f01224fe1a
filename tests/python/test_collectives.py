"""The extension's collectives over multi-process gloo, against the Rust core's in-process
collective (same seed, same inputs): byte for byte, for every preset and topology."""

import contextlib
import json
import types
from pathlib import Path

import integer_sum_scenarios
import pytest
import scenarios
import torch
from harness import run_ranks

from sdp4bit import Config, GradReduceScatter, Sdp4bitError, WeightAllGather
from sdp4bit.collectives import _refuse_graph_capture

TOPOLOGIES = {
    "W4-2x2": [0, 0, 1, 1],
    "W4-1x4": [0, 0, 0, 0],
    "W4-4x1": [0, 1, 2, 3],
    "W3-unequal-2+1": [0, 0, 1],
    "W6-3x2": [0, 0, 1, 1, 2, 2],
}


@pytest.mark.parametrize("name", TOPOLOGIES)
def test_every_preset_equals_the_in_process_collective(name):
    labels = TOPOLOGIES[name]
    reports = run_ranks(len(labels), scenarios.byte_equal_to_in_process, labels,
                        scenarios.PRESETS, False)
    for preset, (rs, rs_base, ag, ag_base) in reports[0].items():
        if preset == "baseline":
            assert (rs, ag) == (rs_base, ag_base)
        else:
            # Exact counts are checked in the Rust tests; here: compression is really on.
            assert rs < rs_base and ag <= ag_base, (preset, rs, rs_base, ag, ag_base)


@pytest.mark.parametrize("name", ["W4-2x2", "W3-unequal-2+1"])
def test_bf16_buckets_equal_their_fp32_conversion_rounded(name):
    labels = TOPOLOGIES[name]
    run_ranks(len(labels), scenarios.bf16_buckets_equal_their_fp32_conversion, labels,
              scenarios.PRESETS)


@pytest.mark.parametrize("name", ["W4-2x2", "W4-1x4", "W4-4x1", "W3-unequal-2+1"])
def test_pipelined_chunks_in_flight_equal_one_chunk(name):
    labels = TOPOLOGIES[name]
    reports = run_ranks(len(labels), scenarios.pipelined_chunks_equal_one_chunk, labels)
    assert reports[0] == ["4", "3", "auto"], reports[0]


def test_topology_from_local_world_size():
    labels = [0, 0, 1, 1]
    run_ranks(4, scenarios.byte_equal_to_in_process, labels, ("sdp4bit",), True,
              env={"LOCAL_WORLD_SIZE": "2"})


def test_repeated_qwd_all_gathers_keep_replicas_identical():
    worst = run_ranks(4, scenarios.repeated_qwd, [0, 0, 1, 1], 40)
    assert worst[0] == worst[1] == worst[2] == worst[3]
    errors = worst[0]
    # Error feedback through the reference: the last steps are no worse than the first ones.
    assert max(errors[-10:]) <= 2 * max(errors[:10]), errors


def test_nan_in_one_rank_reaches_every_owner():
    run_ranks(4, scenarios.nan_reaches_the_owner, [0, 0, 1, 1], scenarios.PRESETS)


def test_mismatched_setups_fail_on_every_rank_within_seconds():
    per_rank = run_ranks(4, scenarios.mismatched_setups)
    for seen in per_rank:
        for message, seconds in seen:
            assert seconds < 5.0, (message, seconds)


def test_bad_inputs_raise_clear_errors():
    run_ranks(4, scenarios.bad_inputs)


def test_many_buckets_in_flight_complete_in_order():
    run_ranks(4, scenarios.many_buckets_in_flight, [0, 0, 1, 1])


def test_integer_sum_overflows_raise_on_every_rank_at_the_same_start():
    """Overflows each rank's readback reports at a start() of its own (rank 2's at start 3,
    ranks 1's and 3's at start 6), with the hosts out of step: every rank raises the same
    errors at the same starts (4 and 7, the lower rank's first), and no rank enqueued those
    steps (every other step equals the in-process collective on every rank)."""
    for raised, shard_len, own in run_ranks(4, integer_sum_scenarios.overflows_raise_at_once,
                                            "cpu"):
        assert raised == integer_sum_scenarios.expected_raises(shard_len), raised
        assert not own, "a CPU bucket raises its own overflows from its step"


def test_graph_capture_is_refused_before_anything_is_enqueued(monkeypatch):
    """A CUDA graph being captured on the current stream of the bucket's device is refused by
    set-up and start() with an error naming it, before the groups or the tensors are looked
    at. torch.cuda is faked: a capture on cuda:1 only, seen when the check selects cuda:1 (not
    the current device) for the query."""
    selected = []

    @contextlib.contextmanager
    def select(device):
        selected.append(torch.device(device))
        yield

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "device", select)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing",
                        lambda: selected[-1] == torch.device("cuda:1"))
    captured = "a CUDA graph is being captured on the current stream of cuda:1"
    on_cuda = types.SimpleNamespace(device=torch.device("cuda:1"))
    rs = GradReduceScatter.__new__(GradReduceScatter)
    ag = WeightAllGather.__new__(WeightAllGather)
    rs.device = ag.device = on_cuda.device
    for make in (lambda: GradReduceScatter(None, Config(), 8, 0, device="cuda:1"),
                 lambda: rs.start(None, None, 0),
                 lambda: WeightAllGather(None, Config(), on_cuda, 0),
                 lambda: ag.start(None, 0)):
        with pytest.raises(Sdp4bitError, match=captured):
            make()
    _refuse_graph_capture("cuda:0", "no capture on cuda:0")
    _refuse_graph_capture("cpu", "nothing to capture")
    assert selected[-1] == torch.device("cuda:0"), selected


#: The ranges of one call of each collective that the trace must hold (src/collective/phases.rs).
PROFILED = {
    "sdp4bit.reduce_scatter": ["encode", "exchange_start", "exchange_wait", "requantize",
                               "decode"],
    "sdp4bit.all_gather": ["encode", "exchange_wait", "decode"],
}


def test_profiler_ranges_name_each_phase_in_the_trace(tmp_path):
    # W = 4 as 2 nodes x 2: the gradient path has both levels. The collectives run on the
    # executor thread, which takes the profiler state of the thread that started them.
    for path, training_thread in run_ranks(4, scenarios.profiled_collectives, [0, 0, 1, 1],
                                           str(tmp_path)):
        events = [e for e in json.loads(Path(path).read_text())["traceEvents"]
                  if e.get("ph") == "X" and e.get("name", "").startswith("sdp4bit.")]
        for call, phases in PROFILED.items():
            calls = [e for e in events if e["name"] == call]
            assert len(calls) == 1, (call, [e["name"] for e in events])
            (outer,) = calls
            assert outer["tid"] != training_thread  # the executor's range, not start()'s
            for phase in phases:
                inner = [e for e in events if e["name"] == f"{call}.{phase}"]
                assert inner, (call, phase, [e["name"] for e in events])
                for e in inner:  # inside the call, on its thread
                    assert e["tid"] == outer["tid"]
                    assert outer["ts"] <= e["ts"] <= e["ts"] + e["dur"] <= outer["ts"] + outer["dur"]

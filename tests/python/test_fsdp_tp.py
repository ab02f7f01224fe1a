"""Tensor parallelism under FSDP2 (a 2-D (dp, tp) mesh, torchtitan's layout) with sdp4bit on
4 gloo ranks: the units' collectives compressed, the TP-replicated parameters exact."""

from __future__ import annotations

import fsdp_tp_scenarios as tp
import sdp4bit.fsdp
from harness import run_ranks

STEPS = 4


def test_tp_replicated_parameters_stay_identical_and_the_control_drifts():
    native = run_ranks(4, tp.train, None, STEPS)
    sdp = run_ranks(4, tp.train, "sdp4bit", STEPS)
    # The control: exact_params=none compresses the TP-replicated elements with the rest.
    control = run_ranks(4, tp.train, sdp4bit.fsdp.preset_config("sdp4bit",
                                                                {"exact_params": "none"}), STEPS)
    for losses, identical, _ in native + sdp:
        assert all(identical), identical
    # Without exact elements the TP copies of norms and row-wise biases drift apart.
    assert any(not all(identical) for _, identical, _ in control)
    for (losses, _, (sent, uncompressed)), (native_losses, _, _) in zip(sdp, native):
        assert 0 < sent < uncompressed / 1.5  # the collectives are compressed
        assert abs(losses[-1] - native_losses[-1]) < 0.1 * native_losses[-1]


def test_float8_all_gather_is_refused_with_a_weight_codec():
    # Hybrid sharding with TP is refused in test_fsdp.py's refusals.
    per_rank = run_ranks(4, tp.float8_gathers)
    assert all("weight_codec=none" in seen for seen in per_rank)

"""FSDP2 hybrid sharding (sdp4bit.fsdp with a 2-D mesh) against native HSDP on the same mesh,
W = 4 as replicate 2 x shard 2 on gloo: gradients for every gradient divide factor and
force-sum setting, and micro-steps that skip the all-reduce."""

from __future__ import annotations

import pytest

import fsdp_hsdp_scenarios as hs
from harness import run_ranks

#: The model's units with gradients: every one all-reduces once per all-reducing micro-step.
UNITS = 3

#: (set_gradient_divide_factor's factor or None, set_force_sum_reduction_for_comms, micro-steps,
#: all but the last with set_requires_all_reduce(False)). The factor 2.0 is the shard size,
#: which FSDP reduce-scatters with AVG without force-sum; another factor is PREMUL_SUM, which
#: gloo lacks, so only the codecs' cases have it; 1.0 is torchtitan's.
EXACT_CASES = [(None, False, 1), (None, True, 1), (2.0, False, 1), (1.0, True, 1),
               (3.0, True, 1), (None, False, 2), (1.0, True, 2), (2.0, False, 3)]
COMPRESSED_CASES = [(None, False, 1), (1.0, True, 1), (3.0, False, 1), (None, True, 2)]
#: The control, sdp4bit blind to the units' divide factor and all-reduce setting.
CONTROL_CASES = [(1.0, True, 1), (2.0, False, 1), (None, False, 2)]


@pytest.fixture(scope="module")
def per_rank():
    # Exact: FSDP's own reduce-scatter and all-gather, the fp32 all-reduce over the replicate
    # dimension (cross_group_bits=exact). Compressed: the default preset, Global-QSGD 8 bits.
    exact = ("baseline", {"cross_group_bits": "exact"})
    return run_ranks(4, hs.against_native, [(*exact, EXACT_CASES, False),
                                            ("sdp4bit", {}, COMPRESSED_CASES, False),
                                            (*exact, CONTROL_CASES, True)])


def test_exact_gradients_equal_native_hsdps_for_every_divide_factor_and_reduction(per_rank):
    # Divisions by 2 and 4 are exact in binary, so the order FSDP and sdp4bit divide in leaves
    # the bits alone: equal bit for bit, the ratio exactly 1.
    for exact, _, _ in per_rank:
        for case, (equal, ratio, _, _) in zip(EXACT_CASES, exact):
            assert equal and ratio == 1.0, (case, ratio)


def test_compressed_gradients_have_native_hsdps_scale(per_rank):
    # 8-bit weights and gradients: each element within a few quantization steps of native
    # HSDP's, so the least-squares ratio is 1 within a percent; a double division by the
    # replicate count would make it 0.5. Factor 3.0 alone: FSDP asks the codecs for PREMUL_SUM.
    for _, compressed, _ in per_rank:
        for case, (_, ratio, _, _) in zip(COMPRESSED_CASES, compressed):
            assert abs(ratio - 1) < 0.01, (case, ratio)


def test_micro_steps_without_all_reduce_skip_it_as_native_hsdp_does(per_rank):
    # set_requires_all_reduce(False): no all-reduce over the replicate dimension on those
    # micro-steps, one per unit on the last, as native HSDP; the gradients after the last
    # equal native HSDP's (exact) or have their scale (compressed).
    for exact, compressed, _ in per_rank:
        for cases, results in ((EXACT_CASES, exact), (COMPRESSED_CASES, compressed)):
            for case, (_, _, ours, native) in zip(cases, results):
                assert ours == native == UNITS, (case, ours, native)


def test_the_control_blind_to_fsdps_settings_differs_from_native_hsdp(per_rank):
    # sdp4bit reading neither setting: a divide factor gives gradients R = 2 times too small
    # (divided by the factor and by R), and every micro-step all-reduces.
    for _, _, control in per_rank:
        (_, torchtitan, _, _), (_, shard_factor, _, _), (equal, _, ours, native) = control
        assert torchtitan == shard_factor == 0.5, control
        assert ours == 2 * native == 2 * UNITS and not equal, control

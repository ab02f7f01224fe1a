"""The Global-QSGD all-reduce across the groups of hybrid sharding (sdp4bit.CrossGroupAllReduce,
docs/numerics.md §7.6) over gloo: W = 4 as 2 groups of 2 ranks."""

from __future__ import annotations

import cross_group_scenarios as scenarios
from harness import run_ranks


def test_every_group_gets_the_in_process_references_bits():
    per_rank = run_ranks(4, scenarios.byte_equal_to_in_process, 4 * 1000, 3)
    for sent, baseline in per_rank:
        # 8-bit sums travel twice (reduce-scatter, all-gather) against fp32's ring: 4x fewer,
        # less the absmax word.
        assert 3.9 < baseline / sent <= 4.0, (sent, baseline)


def test_a_nan_makes_its_cross_groups_buffer_nan_on_every_rank():
    per_rank = run_ranks(4, scenarios.nan_reaches_every_group)
    assert [nan for nan, _ in per_rank] == [True, False, True, False]
    assert [finite for _, finite in per_rank] == [False, True, False, True]


def test_mismatched_setups_and_bad_plans_fail_on_every_rank():
    for messages in run_ranks(4, scenarios.mismatched_setups):
        assert len(messages) == 4, messages

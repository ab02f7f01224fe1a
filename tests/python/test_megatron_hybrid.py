"""Hybrid sharding at scale and with tensor parallelism (megatron-core's
num_distributed_optimizer_instances > 1, gloo on CPU)."""

import megatron_hybrid_scenarios as hs
from harness import run_ranks

ENV = {"LOCAL_WORLD_SIZE": "1"}


def test_process_groups_do_not_grow_with_the_bucket_count():
    # One set of groups per (DP group, instance), shared by every bucket group and built with
    # the model: as many new_group calls for 20+ bucket groups as for 2, none while training
    # (the backward hooks). The control is the bucket count itself: a set per bucket group,
    # as before, would make the first count 10x the second.
    for many, few in run_ranks(4, hs.process_groups_per_bucket_count, [100, 10**5], 2, env=ENV):
        (buckets, groups, built, trained), (_, few_groups, few_built, few_trained) = many, few
        assert buckets >= 20 and groups >= 20 and few_groups <= 2, (buckets, groups, few_groups)
        assert built == few_built > 0, (built, few_built)
        assert trained == few_trained == 0, (trained, few_trained)


def test_hybrid_with_tensor_parallelism_keeps_tp_copies_and_instances_identical():
    # TP = 2 x 2 instances of one rank: the replicated parameters travel exact inside the
    # instance and across the instances (their fp32 sums all-reduced over both), so the TP
    # copies are bit-identical after every step and both instances hold the same bits; the
    # control, exact_params=none, lets Global-QSGD round the replicated gradients differently
    # on each TP rank: the copies drift and the check names the parameter.
    steps = 4
    for kept, drifted in run_ranks(4, hs.hybrid_with_tensor_parallelism,
                                   [{}, {"exact_params": "none"}], steps, env=ENV):
        per_step, (sent, exact) = kept
        assert [e for e, _, _ in per_step] == [None] * steps, per_step
        assert all(not differing and same for _, differing, same in per_step), per_step
        assert 0 < exact < sent, (sent, exact)
        per_step, (sent, exact) = drifted
        assert exact == 0 and all(same for _, _, same in per_step), per_step
        assert any(differing for _, differing, _ in per_step), per_step
        error, differing, _ = next(s for s in per_step if s[1])
        assert error is not None and differing[0] in error, (error, differing)

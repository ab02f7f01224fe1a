"""megatron-core's real GPTModel, DDP and DistributedOptimizer (gloo, CPU) with the sdp4bit
integration: the test command runs this file against megatron-core 0.16.1 and 0.19.2."""

import re

import pytest

import megatron_scenarios as ms
from harness import run_ranks

STEPS = 3
ENV = {"LOCAL_WORLD_SIZE": "2"}


def test_the_cpu_shims_are_the_ones_this_megatron_core_needs():
    (shims, version), = run_ranks(1, ms.needed_shims)
    expected = ["current_device", "side_streams", "rng_tracker", "synchronize"]
    if tuple(int(p) for p in version.split(".")[:2]) >= (0, 19):
        expected.insert(1, "current_stream")  # 0.19's grad sync waits on the current stream
    assert shims == expected, (version, shims)


def _train(preset, overlap_grad=False, overlap_param=False, nan_step=None, core=False,
           bucket_size=ms.BUCKET, grad_fp32=True):
    return run_ranks(4, ms.train, preset, overlap_grad, overlap_param, STEPS, nan_step, core,
                     bucket_size, grad_fp32, env=ENV)


def test_baseline_preset_is_bit_exact_with_megatrons_own_path():
    own = _train(None, overlap_grad=True)
    ours = _train("baseline", overlap_grad=True)
    for (own_losses, _, own_params, _, _), (losses, stepped, params, bytes_, _) in zip(
            own, ours):
        assert all(stepped)
        assert own_losses == losses
        assert own_params == params
        assert bytes_[0] == bytes_[1] > 0  # uncompressed: sent what Megatron sends


def test_sdp4bit_matches_the_core_and_keeps_replicas_identical():
    # Every bucket's shard against the core's, each step: one bucket without
    # overlap_grad_reduce, several buckets and bucket groups synced from backward hooks with it.
    for overlap_grad, expected_buckets in ((False, 1), (True, None)):
        results = _train("sdp4bit", overlap_grad=overlap_grad, core=True)
        losses, stepped, params, (sent, baseline), buckets = results[0]
        assert all(stepped)
        assert losses[-1] < losses[0], losses
        assert all(r[2] == params for r in results)  # replicas bit-identical (checked inside too)
        assert buckets == expected_buckets if expected_buckets else buckets > 1, buckets
        if not overlap_grad:  # one bucket: little padding to the 2048-element weight groups
            assert 0 < sent < baseline / 3, (sent, baseline)


def _same_runs(a, b, what):
    for (losses_a, _, params_a, _, _), (losses_b, _, params_b, _, _) in zip(a, b):
        assert losses_a == losses_b, what
        assert params_a == params_b, what


def test_overlap_on_and_off_give_identical_results():
    # Quantization groups follow the bucket layout, and megatron-core uses one bucket when
    # overlap_grad_reduce is off: compare layouts that agree. One bucket: grad overlap on/off.
    one_bucket = 10**7
    off = _train("sdp4bit", bucket_size=one_bucket)
    on = _train("sdp4bit", overlap_grad=True, bucket_size=one_bucket)
    _same_runs(off, on, "overlap_grad_reduce, one bucket")
    # Several buckets and bucket groups: param-gather overlap on/off.
    off = _train("sdp4bit", overlap_grad=True)
    on = _train("sdp4bit", overlap_grad=True, overlap_param=True)
    _same_runs(off, on, "overlap_param_gather, several buckets")


def test_nan_gradient_skips_the_step_through_megatrons_found_inf_check():
    # One NaN in rank 1's gradient at step 1: the DistributedOptimizer skips that step on
    # every rank (its grad scaler's found-inf flag, all-reduced over the DP group).
    results = _train("sdp4bit", nan_step=1)
    for _, stepped, _, _, _ in results:
        assert stepped == [True, False, True], stepped


def test_bf16_gradient_buffers_match_the_core_and_reach_the_found_inf_check():
    # grad_reduce_in_fp32=False: the bf16 buckets go into the collective as they are (read as
    # fp32, the shard rounded to bf16), each shard equal to the core's of their fp32 values
    # rounded; a NaN still skips the step on every rank.
    results = _train("sdp4bit", overlap_grad=True, core=True, grad_fp32=False)
    losses, stepped, params, _, _ = results[0]
    assert all(stepped)
    assert losses[-1] < losses[0], losses
    assert all(r[2] == params for r in results)
    for _, stepped, _, _, _ in _train("sdp4bit", nan_step=1, grad_fp32=False):
        assert stepped == [True, False, True], stepped


def test_resumed_run_continues_bit_for_bit_with_the_state_saved_apart(tmp_path):
    # dp_reshardable, the format of megatron-core's torch.optim path that works (with the
    # workarounds of megatron_on_cpu/megatron_checkpoint.py); see the next test for the others.
    # sdp4bit's state goes through state_dict / load_state_dict in the checkpoint's common
    # part (its entry in the model's sharded state dict left out of the load), as with a
    # checkpoint of another kind; test_megatron_resume.py resumes through that entry.
    directory = str(tmp_path)
    straight = run_ranks(4, ms.train_with_checkpoint, 4, 2, directory, False, env=ENV)
    resumed = run_ranks(4, ms.train_with_checkpoint, 4, 2, directory, True, env=ENV)
    for (losses, params), (resumed_losses, resumed_params) in zip(straight, resumed):
        assert resumed_losses == losses[2:]
        assert resumed_params == params


def test_megatron_checkpoint_formats_without_sdp4bit_show_megatrons_bugs(tmp_path):
    found = run_ranks(2, ms.checkpoint_bugs, str(tmp_path))[0]
    # 1: a never-stepped torch Adam cannot give the state dict a load starts from.
    assert found["load_into_fresh"].startswith("AssertionError") and found[
        "load_into_fresh"].endswith("distrib_optimizer.py:state_dict"), found
    # 2: after a dp_reshardable load Adam's step is one tensor shared by every parameter and
    # holds the loading optimizer's step (0), not the saved one (2); worked around.
    params, distinct = found["adam_step_tensors_after_load"]
    assert params > 1 and distinct == 1, found
    assert found["adam_steps_after_load"] == [0.0] and found["saved_step"] == 2.0, found
    assert found["adam_steps_worked_around"] == (params, [2.0]), found
    # 3: fully_reshardable saves the parameters after a padded bucket with other state.
    assert found["padded_buckets"] >= 1 and found["buckets"] >= 2, found
    right, total = found["fully_reshardable_params_saved_right"]
    assert 0 < right < total, found
    # 4: the gathered formats do not load.
    for fmt in ("fully_reshardable", "dp_zero_gather_scatter"):
        assert found[f"{fmt}_load"] == (
            "KeyError: 'step' @ distrib_optimizer.py:_set_main_param_and_optimizer_states"), found
    # The default format fails at save.
    assert found["fully_sharded_model_space_save"].startswith(
        "CheckpointingException: ShardedTensor.flattened_range is not supported."), found


def test_telemetry_reports_bytes_and_error_at_the_interval():
    per_rank = run_ranks(4, ms.telemetry, 5, 2, env=ENV)
    scalars, wandb_scalars = per_rank[0]
    assert wandb_scalars == scalars  # Megatron-LM's wandb writer gets the same
    steps = {step for (_, step) in scalars}
    assert steps == {0, 2, 4}, steps
    for step in (0, 2, 4):
        sent = scalars[("sdp4bit/grad/bytes_sent", step)]
        assert 0 < sent < scalars[("sdp4bit/grad/bytes_uncompressed", step)] / 2  # tiny buckets
        # 8-bit then 4-bit gradients: a clearly non-zero but bounded relative error.
        assert 1e-3 < scalars[("sdp4bit/grad/rel_l2_error", step)] < 0.5
        assert scalars[("sdp4bit/grad/nonfinite", step)] == 0
    for step in (2, 4):  # the first sync after set-up sends nothing
        assert 0 < scalars[("sdp4bit/param/rel_l2_error", step)] < 0.05
        assert scalars[("sdp4bit/param/bytes_sent", step)] > 0


def test_tensor_parallel_dp_groups_and_several_model_chunks():
    # W = 4, TP = 2: DP groups {0, 2} and {1, 3}, one rank per node each; two model chunks.
    per_rank = run_ranks(4, ms.tensor_parallel_and_chunks, 2, 2, 3, env=ENV)
    for losses, group_sizes in per_rank:
        assert len(losses) == 3 and group_sizes == {2}
        assert losses[-1] < losses[0], losses


def test_pipeline_parallel_dp_groups_per_stage():
    per_rank = run_ranks(4, ms.pipeline_parallel, 3, env={"LOCAL_WORLD_SIZE": "1"})
    assert [stage for stage, _, _ in per_rank] == [0, 0, 1, 1]
    assert all(sizes == {2} for _, sizes, _ in per_rank)
    last = [losses for stage, _, losses in per_rank if stage == 1]
    assert all(len(losses) == 3 and losses[-1] < losses[0] for losses in last), last


def test_degraded_route_is_logged_once_per_bucket_group_and_rank_0_says_sdp4bit_is_on():
    per_rank = run_ranks(3, ms.route_notice, 2, env=ENV)
    for rank, (bucket_groups, messages) in enumerate(per_rank):
        notices = [m for m in messages if "unequal" in m]
        assert bucket_groups > 1 and len(notices) == bucket_groups, messages
        started = [m for m in messages if m.startswith("sdp4bit enabled for megatron-core")]
        assert len(started) == (rank == 0), messages
        # Once the model's bucket groups are set up: its buckets and the bytes of a step.
        set_up = [m for m in messages if m.startswith("sdp4bit set up model chunk 0: ")]
        assert len(set_up) == (rank == 0), messages
        if set_up:
            found = re.search(r"(\d+) buckets, (\d+) compressed \(0 wholly exact\); a step "
                              r"sends ([\d,]+) B from this rank against ([\d,]+) B", set_up[0])
            assert found, set_up
            buckets, compressed, sent, uncompressed = (int(g.replace(",", ""))
                                                       for g in found.groups())
            assert buckets == compressed >= bucket_groups and 0 < sent < uncompressed / 2


@pytest.mark.parametrize("overlap", [False, True])
def test_hybrid_sharding_sums_global_qsgd_integers_across_instances(overlap):
    # W = 4 as 2 distributed-optimizer instances of 2 ranks: the reduce-scatter inside each
    # instance, then Global-QSGD's all-reduce of each shard across them (every one equal to the
    # core's in-process all-reduce), and every rank of both instances ends every step with the
    # same parameters; Megatron's own partial distributed optimizer beside it.
    env = {"LOCAL_WORLD_SIZE": "1"}
    ours = run_ranks(4, ms.hybrid_sharding, "sdp4bit", {}, overlap, 4, env=env)
    own = run_ranks(4, ms.hybrid_sharding, None, {}, overlap, 4, env=env)
    for (losses, identical, (sent, uncompressed), compared, _), (own_losses, own_identical, *_) \
            in zip(ours, own):
        assert identical and own_identical
        assert compared and all(compared), compared
        assert 0 < sent < uncompressed / 3, (sent, uncompressed)
        assert losses[-1] < losses[0], losses
        assert abs(losses[-1] - own_losses[-1]) < 0.1 * own_losses[-1], (losses, own_losses)


def test_hybrid_sharding_with_an_exact_all_reduce_across_instances():
    # cross_group_bits=exact: Megatron's fp32 all-reduce across the instances, counted at its
    # full size; the replicas stay identical.
    per_rank = run_ranks(4, ms.hybrid_sharding, "sdp4bit", {"cross_group_bits": "exact"},
                         False, 3, env={"LOCAL_WORLD_SIZE": "1"})
    for losses, identical, (sent, uncompressed), compared, _ in per_rank:
        assert identical and compared == [] and losses[-1] < losses[0]
        assert 0 < sent < uncompressed


def test_instances_of_one_rank_still_compress_the_all_reduce_across_them():
    # W = 2 as 2 instances of one rank: nothing to reduce-scatter inside an instance, and the
    # all-reduce across them is still Global-QSGD's (not Megatron's fp32 one).
    for losses, identical, (sent, uncompressed), compared, _ in run_ranks(
            2, ms.hybrid_sharding, "sdp4bit", {}, False, 3, env={"LOCAL_WORLD_SIZE": "1"}):
        assert identical and compared and all(compared), compared
        assert 0 < sent < uncompressed / 2, (sent, uncompressed)


def test_a_nan_in_one_instance_skips_the_step_in_both():
    # Rank 1 (instance 0) poisons a gradient at step 1: the all-reduce across the instances
    # carries the NaN to instance 1, and Megatron's found-inf check skips the step on all four
    # ranks, which stay identical.
    per_rank = run_ranks(4, ms.hybrid_sharding, "sdp4bit", {}, False, 3, 1,
                         env={"LOCAL_WORLD_SIZE": "1"})
    for _, identical, _, _, stepped in per_rank:
        assert stepped == [True, False, True] and identical, stepped


def test_parameters_kept_exact_are_named_in_one_warning_with_their_share_of_the_bytes():
    # exact_params=norms-biases-embeddings (a fallback the user asks for): rank 0 warns once,
    # naming each bucket or bucket's elements left uncompressed and its share of a step's bytes;
    # the default (replicated, nothing replicated without TP) warns nothing.
    per_rank = run_ranks(2, ms.exact_params_notice, "norms-biases-embeddings", env=ENV)
    assert per_rank[1] == []
    (warning,) = per_rank[0]
    assert warning.startswith("sdp4bit model chunk 0: exact_params=norms-biases-embeddings "
                              "leaves uncompressed "), warning
    shares = [float(p) for p in re.findall(r"\(([\d.]+)%\)", warning)]
    assert shares and all(0 < p < 100 for p in shares), warning
    assert "embedding" in warning and "layernorm" in warning.lower(), warning
    assert run_ranks(2, ms.exact_params_notice, "replicated", env=ENV) == [[], []]


def test_exact_elements_keep_their_values_through_the_qwd_all_gather():
    # This rank's exact elements taken out (0 at set-up and at every step) give qWD
    # differences of exactly 0 there, so every replica's apply leaves the exact elements as
    # they were (then they get the owners' exact values); the control, leaving them in,
    # changes them.
    for held in run_ranks(2, ms.exact_elements_beside_qwd, True, 6):
        assert held == [True] * 6, held
    for held in run_ranks(2, ms.exact_elements_beside_qwd, False, 6):
        assert not any(held), held


def test_what_sdp4bit_does_not_compress_is_refused_when_the_model_is_built():
    # Never a silent fallback to Megatron's own traffic: each setting raises naming what to
    # change; the control builds the same without sdp4bit and gets no error of sdp4bit's.
    for results in run_ranks(2, ms.refused_settings):
        assert [r[0] for r in results] == [name for name, _, _ in ms.REFUSED]
        for (name, with_sdp4bit, without), (_, _, expected) in zip(results, ms.REFUSED):
            assert with_sdp4bit is not None and expected in with_sdp4bit, (name, with_sdp4bit)
            assert without is None or without.startswith("not sdp4bit's"), (name, without)


def test_enable_none_leaves_megatron_as_it_is():
    # enable(config_from_args(args)) with no sdp4bit flag: config_from_args gives None, and
    # enable(None) patches nothing; the control, enable with a config, patches (and disable
    # restores).
    (none, config, disabled), = run_ranks(1, ms.enable_none)
    assert none == (False, False) and config == (True, True) and disabled == (False, False)


def test_exact_elements_are_held_as_ranges_whatever_their_size():
    # A 1M-element embedding kept exact beside a compressed weight: the structure holds two
    # ranges, under 1 KB pickled and no tensor, where one int64 index per element took 8 MiB;
    # the bytes sent are those of the same elements, and the gradient sums and gathered values
    # equal those read through the per-element index.
    for held, holds_tensor, index_bytes, sent, indexed_sent, equal in run_ranks(
            2, ms.exact_ranges_of_an_embedding):
        assert index_bytes == 8 * ms.EMBEDDING and held < 1024 and not holds_tensor, held
        assert sent == indexed_sent and equal, (sent, indexed_sent)


def test_a_negative_replica_check_interval_is_refused():
    with pytest.raises(ValueError, match="replica_check_interval must be a non-negative int"):
        ms.integration.enable(ms.Config("sdp4bit"), replica_check_interval=-1)
    assert not ms.integration.is_enabled()


#: Steps of the copies test, each compared across the TP and the embedding group.
COPY_STEPS = 20
#: Per layout (megatron_scenarios.LAYOUTS): (name, preset or None for Megatron's own
#: collectives, knobs, overlapped syncs). The names ending in "(control)" show the comparison
#: failing: nothing kept exact across TP ranks, the tied embedding's buckets numbered apart.
COPY_VARIANTS = {
    "tp": [
        ("megatron", None, {}, False),
        ("sdp4bit", "sdp4bit", {}, False),
        ("sdp4bit overlapped, 2 chunks", "sdp4bit", {"pipeline_chunks": "2"}, True),
        ("qsdp overlapped", "qsdp", {}, True),
        ("zeropp", "zeropp", {}, False),
        ("global-qsgd", "global-qsgd", {}, False),
        ("norms, biases, embeddings", "sdp4bit", {"exact_params": "norms-biases-embeddings"},
         False),
        ("sdp4bit, nothing exact (control)", "sdp4bit", {"exact_params": "none"}, False),
        ("qsdp, nothing exact (control)", "qsdp", {"exact_params": "none"}, False),
    ],
    "tp-sp": [
        ("megatron", None, {}, False),
        ("sdp4bit", "sdp4bit", {}, False),
        ("sdp4bit overlapped", "sdp4bit", {}, True),
        ("qsdp", "qsdp", {}, False),
        ("sdp4bit, nothing exact (control)", "sdp4bit", {"exact_params": "none"}, False),
    ],
    "pp": [
        ("megatron", None, {}, False),
        ("sdp4bit", "sdp4bit", {}, False),
        ("sdp4bit overlapped, 2 chunks", "sdp4bit", {"pipeline_chunks": "2"}, True),
        ("qsdp", "qsdp", {}, False),
        ("zeropp", "zeropp", {}, False),
        ("norms, biases, embeddings", "sdp4bit", {"exact_params": "norms-biases-embeddings"},
         False),
        ("tied ids differ (control)", "sdp4bit", {}, False),
    ],
}


@pytest.mark.parametrize("layout", ["tp", "tp-sp", "pp"])
def test_copies_megatron_keeps_identical_stay_bit_identical(layout):
    # TP = 2 (with and without sequence parallelism): the parameters replicated across TP
    # ranks; PP = 2: the word embedding tied between the stages. Compared bit for bit as every
    # step's gradient sync starts and after the last step, with every preset; the controls
    # drift, and sdp4bit's check stops them at the first comparison that differs, naming the
    # first tensor that does.
    variants = COPY_VARIANTS[layout]
    per_rank = run_ranks(4, ms.copies_across_groups, layout, variants, COPY_STEPS,
                         timeout=600)
    for results in per_rank:
        for name, preset, knobs, _ in variants:
            got = results[name]
            differs = [bool(tp or tied) for tp, tied in got["compared"]]
            if name.endswith("(control)"):
                assert any(differs), (layout, name)
                first = differs.index(True)
                step, message = got["check"]
                assert step == first, (layout, name, step, first)
                tp_names, tied = got["compared"][first]
                assert (tp_names and tp_names[0] in message) or (tied and any(
                    n in message for n in ("word_embeddings", "output_layer"))), message
            else:
                assert got["check"] is None, (layout, name, got["check"])
                assert len(differs) == COPY_STEPS + 1 and not any(differs), (layout, name)
            if preset is None:
                continue
            sent, exact = got["wire"]
            mode = knobs.get("exact_params", "replicated")
            # Bytes: the replicated parameters' exact paths cost bytes under TP only; the tied
            # embedding costs nothing (its whole bucket does, kept exact).
            keeps = mode == "norms-biases-embeddings" or (mode == "replicated" and layout != "pp")
            assert (exact > 0) == keeps and sent > exact, (layout, name, sent, exact)
        if layout != "pp":
            # 2 layers x (2 norms' weight and bias, 2 row-parallel biases), the final norm's
            # weight and bias, the position embedding.
            assert results["megatron"]["replicated"] == 15

"""megatron-core DDP (real bucket groups, gloo, CPU) with the sdp4bit integration."""

import megatron_scenarios as ms
from harness import run_ranks

STEPS = 4


def _train(preset, overlap_grad=False, overlap_param=False, **kwargs):
    return run_ranks(4, ms.train, preset, overlap_grad, overlap_param, STEPS, None, False,
                     env={"LOCAL_WORLD_SIZE": "2"}, **kwargs)


def test_baseline_preset_is_bit_exact_with_megatrons_own_path():
    own = run_ranks(4, ms.train, None, False, False, STEPS, env={"LOCAL_WORLD_SIZE": "2"})
    ours = run_ranks(4, ms.train, "baseline", False, False, STEPS, env={"LOCAL_WORLD_SIZE": "2"})
    for (own_losses, _, own_params, _), (losses, _, params, bytes_) in zip(own, ours):
        assert own_losses == losses
        assert own_params == params
        assert bytes_[0] == bytes_[1] > 0  # uncompressed: sent what Megatron sends


def test_sdp4bit_matches_the_core_and_keeps_replicas_identical():
    results = run_ranks(4, ms.train, "sdp4bit", False, False, STEPS, None, True,
                        env={"LOCAL_WORLD_SIZE": "2"})
    losses, stepped, _, (sent, baseline) = results[0]
    assert all(stepped)
    assert losses[-1] < losses[0], losses
    # Tiny buckets: per-shard padding to the 2048-element weight groups costs a little.
    assert 0 < sent < baseline / 3, (sent, baseline)


def _same_runs(a, b, what):
    for (losses_a, _, params_a, _), (losses_b, _, params_b, _) in zip(a, b):
        assert losses_a == losses_b, what
        assert params_a == params_b, what


def test_overlap_on_and_off_give_identical_results():
    # Quantization groups follow the bucket layout, and megatron-core uses one bucket when
    # overlap_grad_reduce is off: compare layouts that agree. One bucket: grad overlap on/off.
    env = {"LOCAL_WORLD_SIZE": "2"}
    one_bucket = 10**6
    off = run_ranks(4, ms.train, "sdp4bit", False, False, STEPS, None, False, one_bucket, env=env)
    on = run_ranks(4, ms.train, "sdp4bit", True, False, STEPS, None, False, one_bucket, env=env)
    _same_runs(off, on, "overlap_grad_reduce, one bucket")
    # Several buckets and bucket groups: param-gather overlap on/off.
    off = run_ranks(4, ms.train, "sdp4bit", True, False, STEPS, env=env)
    on = run_ranks(4, ms.train, "sdp4bit", True, True, STEPS, env=env)
    _same_runs(off, on, "overlap_param_gather, several buckets")


def test_nan_gradient_trips_the_found_inf_check_on_every_rank():
    results = run_ranks(4, ms.train, "sdp4bit", False, False, STEPS, 1,
                        env={"LOCAL_WORLD_SIZE": "2"})
    for _, stepped, _, _ in results:
        assert stepped == [True, False, True, True], stepped


def test_resumed_run_continues_bit_for_bit(tmp_path):
    env = {"LOCAL_WORLD_SIZE": "2"}
    for overlap_param in (False, True):
        (tmp_path / f"a{overlap_param}").mkdir()
        (tmp_path / f"b{overlap_param}").mkdir()
        straight = run_ranks(4, ms.train_segment, 0, 5, str(tmp_path / f"a{overlap_param}"),
                             overlap_param, env=env)
        first = run_ranks(4, ms.train_segment, 0, 2, str(tmp_path / f"b{overlap_param}"),
                          overlap_param, env=env)
        second = run_ranks(4, ms.train_segment, 2, 5, str(tmp_path / f"b{overlap_param}"),
                           overlap_param, env=env)
        for (losses, params), (l1, _), (l2, resumed) in zip(straight, first, second):
            assert l1 + l2 == losses, overlap_param
            assert resumed == params, overlap_param


def test_telemetry_reports_bytes_and_error_at_the_interval():
    per_rank = run_ranks(4, ms.telemetry, 5, 2, env={"LOCAL_WORLD_SIZE": "2"})
    scalars = per_rank[0]
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
    per_rank = run_ranks(4, ms.tensor_parallel_and_chunks, 2, 2, 3, env={"LOCAL_WORLD_SIZE": "2"})
    for losses in per_rank:
        assert len(losses) == 3


def test_pipeline_parallel_dp_groups_per_stage():
    per_rank = run_ranks(4, ms.pipeline_parallel, 4, env={"LOCAL_WORLD_SIZE": "1"})
    assert [stage for stage, _ in per_rank] == [0, 0, 1, 1]
    last = [losses for stage, losses in per_rank if stage == 1]
    assert all(len(losses) == 4 for losses in last)
    assert all(losses[-1] < losses[0] for losses in last), last


def test_degraded_route_is_logged_once_per_bucket_group():
    per_rank = run_ranks(3, ms.route_notice, 2, env={"LOCAL_WORLD_SIZE": "2"})
    for bucket_groups, messages in per_rank:
        notices = [m for m in messages if "unequal" in m]
        assert bucket_groups > 1 and len(notices) == bucket_groups, messages

"""PyTorch FSDP2 integration on CPU (gloo): sdp4bit's codecs as the units' all-gather and
reduce-scatter (sdp4bit.fsdp)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

import fsdp_scenarios as fs
import sdp4bit.fsdp
from harness import run_ranks
from sdp4bit import Config, Sdp4bitError

ROOT = Path(__file__).resolve().parents[2]


def test_baseline_preset_is_bit_exact_with_fsdp2s_own_collectives():
    per_rank = run_ranks(4, fs.own_and_baseline, 4, env={"LOCAL_WORLD_SIZE": "2"})
    for own, baseline in per_rank:
        assert baseline["losses"] == own["losses"]
        assert baseline["params"] == own["params"]
        sent, uncompressed = baseline["wire"]
        assert 0 < sent == uncompressed
    assert len({own["params"] for own, _ in per_rank}) == 1


def test_w4_collectives_equal_the_core_with_the_topology_given():
    # W = 4 as 2 nodes x 2 ranks from local_world_size (LOCAL_WORLD_SIZE says otherwise):
    # qsdp weights, two-level TLq-HS gradients, three units (fp32 AVG, bf16 AVG, fp32 SUM).
    per_rank = run_ranks(4, fs.train, "sdp4bit", 3, True, None, {"local_world_size": 2},
                         env={"LOCAL_WORLD_SIZE": "4"})
    for result in per_rank:
        assert result["node_labels"] == [0, 0, 1, 1]
        # per step: 3 gathers in forward, 2 re-gathers in backward, 3 reduce-scatters
        assert result["compared"] == 3 * 8
        sent, uncompressed = result["wire"]
        assert 0 < sent < uncompressed
        assert all(math.isfinite(loss) for loss in result["losses"])


def test_w2_every_codec_equals_the_core():
    setups = [
        {"config": "zeropp"},
        {"config": "qsdp"},
        {"config": "global-qsgd"},  # weights through FSDP's own all-gather, counted
        {"config": Config("baseline", weight_codec="qw", grad_codec="tlq"),
         "local_world_size": 1},
        # Steps numbered from 3: step 3 reduces uncompressed, step 4 compressed.
        {"config": Config("sdp4bit", weight_codec="zeropp", grad_quant_start_step=4),
         "first_step": 3, "node_labels": [0, 1]},
    ]
    per_rank = run_ranks(2, fs.each_codec, setups, 2)
    expected_codecs = [("zeropp", "zeropp"), ("qsdp", "qsdp"), ("none", "global-qsgd"),
                       ("qw", "tlq"), ("zeropp", "tlq-hs")]
    for report in per_rank:
        for (codecs, compared, (sent, uncompressed)), expected in zip(report, expected_codecs):
            assert codecs == expected
            assert compared == 2 * 8, codecs
            assert 0 < sent < uncompressed, codecs


def test_one_rank_trains_bit_exact_with_fsdps_own():
    # torch 2.9 calls the reduce-scatter at world size 1 too (2.11 skips it): the core copies
    # (docs/numerics.md §7.4), every call checked against it, so training is FSDP's own.
    own = run_ranks(1, fs.train, None, 3)[0]
    ours = run_ranks(1, fs.train, "sdp4bit", 3, True)[0]
    assert ours["losses"] == own["losses"] and ours["params"] == own["params"]
    assert ours["wire"] == (0, 0)


def test_loss_tracks_fsdps_own():
    steps = 30
    own = run_ranks(2, fs.train, None, steps)[0]["losses"]
    compressed = run_ranks(2, fs.train, "sdp4bit", steps)[0]["losses"]
    tail = slice(steps - 10, steps)
    own_tail = sum(own[tail]) / 10
    tail_loss = sum(compressed[tail]) / 10
    assert own_tail < 0.2 * own[0], "FSDP's own run did not learn"
    assert abs(tail_loss - own_tail) < 0.05 * own_tail, (tail_loss, own_tail)


def test_nan_gradient_makes_every_rank_skip_the_step():
    # A NaN in rank 1's batch at step 1: the compressed reduce-scatter carries it into the
    # owners' shards, the gradient norm is NaN on every rank, and every rank skips the step.
    per_rank = run_ranks(4, fs.train, "sdp4bit", 3, False, 1, env={"LOCAL_WORLD_SIZE": "2"})
    assert [r["skipped"] for r in per_rank] == [[1]] * 4
    assert any(r["nonfinite_shards"] == [True] for r in per_rank)
    assert all(math.isfinite(r["losses"][2]) for r in per_rank)


def test_telemetry_reports_bytes_and_error_at_the_interval():
    scalars = run_ranks(2, fs.telemetry, 4, 2)[0]
    for kind in ("grad", "param"):
        assert {step for (name, step) in scalars if name.startswith(f"sdp4bit/{kind}/")} == {0, 2}
        for step in (0, 2):
            sent = scalars[(f"sdp4bit/{kind}/bytes_sent", step)]
            assert 0 < sent < scalars[(f"sdp4bit/{kind}/bytes_uncompressed", step)]
            assert scalars[(f"sdp4bit/{kind}/nonfinite", step)] == 0
    # 8-bit qsdp weights: an element's error is under a step (range / 255) of its group
    # (docs/numerics.md §1.2).
    assert 0 < scalars[("sdp4bit/param/rel_l2_error", 2)] < 0.05
    assert 0 < scalars[("sdp4bit/grad/rel_l2_error", 2)] < 1


def test_what_it_cannot_serve_is_refused_on_every_rank():
    per_rank = run_ranks(4, fs.refusals)
    assert all(len(seen) == 8 for seen in per_rank)


def test_hybrid_sharding_all_reduces_global_qsgd_integers_over_the_replicate_dimension():
    # W = 4 as replicate 2 x shard 2: sdp4bit's all-gather and reduce-scatter inside each shard
    # group, then Global-QSGD's all-reduce over the replicate dimension from FSDP's all-reduce
    # hook (every one equal to the core's in-process one); the replicas' shards stay
    # identical; FSDP's native HSDP on the same mesh beside it.
    ours = run_ranks(4, fs.hybrid, "sdp4bit", 6)
    native = run_ranks(4, fs.hybrid, None, 6)
    for (losses, identical, compared, (sent, uncompressed)), (own_losses, own_identical, _, _) \
            in zip(ours, native):
        assert identical and own_identical
        assert compared and all(compared), compared
        assert 0 < sent < uncompressed / 2, (sent, uncompressed)
        assert losses[-1] < losses[0], losses
        assert abs(losses[-1] - own_losses[-1]) < 0.1 * own_losses[-1], (losses, own_losses)


def test_hybrid_sharding_over_shard_groups_of_one_rank():
    # W = 2 as replicate 2 x shard 1 (FSDP skips the reduce-scatter): the hook's all-reduce is
    # still Global-QSGD's, numbered by the unit's syncs.
    for losses, identical, compared, (sent, uncompressed) in run_ranks(2, fs.hybrid, "sdp4bit",
                                                                       3):
        assert identical and compared and all(compared), compared
        assert losses[-1] < losses[0] and 0 < sent < uncompressed


def test_hybrid_sharding_with_an_exact_replicate_all_reduce():
    for losses, identical, compared, _ in run_ranks(4, fs.hybrid, "sdp4bit", 3, "exact"):
        assert identical and compared == [] and losses[-1] < losses[0]


def test_preset_names_read_qwd_as_qsdp(capsys):
    assert sdp4bit.fsdp.preset_config("sdp4bit").codecs() == ("qsdp", "tlq-hs")
    # The weight rule shared with ZeRO-3 (docs/configuration.md): one line says so.
    said = capsys.readouterr().out
    assert said.count("qWD weights need every rank to keep the previous weights") == 1
    assert "its weights run with qsdp (8-bit) instead; set weight_codec" in said
    assert sdp4bit.fsdp.preset_config("sdp4bit", {"weight_codec": "qw"}).codecs() == (
        "qw", "tlq-hs")
    assert sdp4bit.fsdp.preset_config("qsdp").codecs() == ("qsdp", "qsdp")
    assert capsys.readouterr().out == ""  # nothing substituted, nothing said
    with pytest.raises(Sdp4bitError, match=r"qWD \(weight_codec=qwd\)"):
        sdp4bit.fsdp.enable(nn.Linear(2, 2), sdp4bit.fsdp.preset_config(
            "sdp4bit", {"weight_codec": "qwd"}))
    assert sdp4bit.fsdp.preset_config("zeropp") == Config("zeropp")
    config = sdp4bit.fsdp.preset_config("sdp4bit", {"weight_bits": "4"})
    assert config.values()["weight_bits"] == "4" and config.codecs()[0] == "qsdp"
    with pytest.raises(Sdp4bitError, match="unknown knob"):
        sdp4bit.fsdp.preset_config("sdp4bit", {"weight_bitz": 4})


@pytest.mark.parametrize("config, error, fragment", [
    (Config("sdp4bit"), Sdp4bitError, "qWD (weight_codec=qwd)"),
    (Config("sdp4bit", weight_bits=3), Sdp4bitError, "weight_bits=3"),
    (Config("qsdp", exact_params="norms-biases-embeddings"), Sdp4bitError,
     "exact_params=norms-biases-embeddings is implemented for megatron-core"),
    ("sdp5bit", Sdp4bitError, "sdp5bit"),
    (42, TypeError, "a sdp4bit.Config or a preset name"),
])
def test_bad_configs_are_refused_before_anything_is_set_up(config, error, fragment):
    with pytest.raises(error) as raised:
        sdp4bit.fsdp.enable(torch.nn.Linear(2, 2), config)
    assert fragment in str(raised.value)


@pytest.mark.parametrize("dtype, fragment", [
    (torch.uint8, "all-gathers raw bytes"),  # float8 and other all-gather extensions
    (torch.float32, "as ['torch.float32']"),
    (torch.float16, "as ['torch.float16']"),
])
def test_weight_codecs_refuse_other_gather_dtypes_than_bf16(dtype, fragment):
    from sdp4bit.fsdp.comms import _check_gather_dtype

    with pytest.raises(Sdp4bitError) as raised:
        _check_gather_dtype(dtype, "FSDP unit 'x'")
    assert fragment in str(raised.value) and "weight_codec=none" in str(raised.value)
    _check_gather_dtype(torch.bfloat16, "FSDP unit 'x'")


def test_the_codecs_divide_as_fsdps_reduce_op_asks():
    # PREMUL_SUM (set_gradient_divide_factor(f) without force-sum) holds 1/f out of Python's
    # reach: the unit's factor gives it.
    import torch.distributed as dist

    from sdp4bit.fsdp.comms import _divisor

    class Unit:
        label, factor = "FSDP unit 'x'", 3.0

        def gradient_divide_factor(self):
            return self.factor

    unit = Unit()
    assert _divisor(dist.ReduceOp.AVG, 4, unit) == 4
    assert _divisor(dist.ReduceOp.SUM, 4, unit) == 1
    assert _divisor(dist._make_nccl_premul_sum(1 / 3.0), 4, unit) == 3.0
    for op, factor in ((dist.ReduceOp.MAX, 3.0), (dist._make_nccl_premul_sum(0.5), None)):
        unit.factor = factor
        with pytest.raises(Sdp4bitError, match="'x' reduce-scatters with (MAX|PREMUL_SUM)"):
            _divisor(op, 4, unit)


def test_a_model_without_fsdp_units_is_refused():
    with pytest.raises(Sdp4bitError, match="no FSDP unit with parameters"):
        sdp4bit.fsdp.enable(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("missing", ["set_custom_all_gather", "set_custom_reduce_scatter"])
def test_torch_without_fsdp2_custom_collectives_is_refused(monkeypatch, missing):
    # torch before 2.9: FSDPModule exists (since 2.6) without the setters.
    monkeypatch.delattr(FSDPModule, missing)
    with pytest.raises(Sdp4bitError) as raised:
        sdp4bit.fsdp.enable(torch.nn.Linear(2, 2))
    assert "needs PyTorch 2.9 or later" in str(raised.value)
    assert f"FSDPModule.{missing}" in str(raised.value)


def test_a_unit_with_several_parameter_groups_is_refused():
    # torch 2.15: shard_placement_fn can put a unit's parameters on meshes of their own, one
    # parameter group each, whose single-group accessor then fails inside torch.
    class State:
        _fsdp_param_groups = [object(), object()]

        @property
        def _fsdp_param_group(self):
            raise AssertionError("Expected at most 1 param group")

    class Unit(torch.nn.Linear):
        def _get_fsdp_state(self):
            return State()

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), Unit(2, 2))
    api = sdp4bit.fsdp._torch.Fsdp2(Unit, object, object)
    with pytest.raises(Sdp4bitError, match="FSDP unit '1' has 2 parameter groups"):
        sdp4bit.fsdp._torch.units(model, api)


def test_the_example_trains_and_writes_its_results(tmp_path):
    out = tmp_path / "fsdp2.json"
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
         str(ROOT / "examples/fsdp2/train.py"), "--ranks-per-node", "2", "--steps", "4",
         "--width", "64", "--corpus-bytes", "300000",
         "--telemetry-interval", "2", "--val-tokens", "16448", "--lr-decay", "cosine",
         "--warmup-steps", "1", "--json-out", str(out)],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"})
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["preset"] == "sdp4bit" and result["codecs"] == ["qsdp", "tlq-hs"]
    assert len(result["train_loss"]) == 4 and all(map(math.isfinite, result["train_loss"]))
    # 257 validation windows of 64 tokens: rank 0 evaluates 65 (two passes of 64), the others
    # 64, and run a second, uncounted pass so that FSDP's all-gathers match.
    assert math.isfinite(result["val_loss"]) and result["val_tokens"] == 16448
    assert 0 < result["sent"] < result["uncompressed"] / 2
    # Gradients at steps 0 and 2; weights also at 4, gathered for the validation loss.
    for kind, steps in (("grad", [0, 2]), ("param", [0, 2, 4])):
        errors = result["telemetry"][kind]
        assert [e["step"] for e in errors] == steps
        assert all(0 < e["rel_l2_error"] < 1 and e["nonfinite"] == 0 for e in errors)
        assert result[f"{kind}_rel_l2"] == [e["rel_l2_error"] for e in errors]


def test_the_example_follows_megatron_cores_learning_rate_schedule():
    # The convergence study gives both examples the same --lr-decay/--warmup-steps/--min-lr.
    from importlib.util import module_from_spec, spec_from_file_location

    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    spec = spec_from_file_location("fsdp2_train", ROOT / "examples/fsdp2/train.py")
    example = module_from_spec(spec)
    spec.loader.exec_module(example)
    for decay, warmup in (("cosine", 5), ("cosine", 0), ("constant", 3)):
        optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.0)
        scheduler = OptimizerParamScheduler(
            optimizer, init_lr=0.0, max_lr=3e-3, min_lr=3e-4, lr_warmup_steps=warmup,
            lr_decay_steps=40, lr_decay_style=decay, start_wd=0.01, end_wd=0.01,
            wd_incr_steps=40, wd_incr_style="constant")
        for step in range(42):
            got = example.learning_rate(step, 3e-3, 3e-4, warmup, 40, decay)
            assert got == pytest.approx(optimizer.param_groups[0]["lr"], rel=1e-12, abs=1e-15)
            scheduler.step(1)

"""DeepSpeed ZeRO integration on CPU (DS_ACCELERATOR=cpu, gloo): the "sdp4bit" config
section, ZeRO stages 1, 2 and 3."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import deepspeed_scenarios as ds
from harness import run_ranks
import sdp4bit.deepspeed as deepspeed_zero
from sdp4bit import Sdp4bitError

CPU = {"DS_ACCELERATOR": "cpu"}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_baseline_preset_is_bit_exact_with_deepspeeds_own_path(stage):
    own = run_ranks(2, ds.train, stage, None, 4, env=CPU)
    baseline = run_ranks(2, ds.train, stage, {"preset": "baseline"}, 4, env=CPU)
    for (own_losses, own_params, _, _), (losses, params, sent, _) in zip(own, baseline):
        assert losses == own_losses
        assert params == own_params
        assert sent == (0, 0)


@pytest.mark.parametrize("stage", [1, 2])
def test_sdp4bit_partitions_equal_the_core_and_replicas_stay_identical(stage):
    # W = 4 as 2 nodes x 2 ranks, two micro-batches per step, an exact all-gather (as when
    # loading a checkpoint) after step 2, which restarts qWD from the gathered weights.
    section = {"preset": "sdp4bit", "ranks_per_node": 2, "seed": 3}
    per_rank = run_ranks(4, ds.train, stage, section, 5, 2, True, 2, env=CPU)
    for losses, _, (sent, uncompressed), compared in per_rank:
        assert compared == 5, "every step's partitions are compared with the core"
        assert all(torch.isfinite(torch.tensor(losses)))
        assert 0 < sent < uncompressed / 3.5  # 4-bit weights and gradients, with group scales
    params = {p for _, p, _, _ in per_rank}
    assert len(params) == 1, "replicas differ"


def test_fp32_gradient_accumulation_stays_fp32_on_zero_2():
    # "grad_accum_dtype": "fp32": DeepSpeed keeps fp32 gradient accumulators, and so does the
    # buffer sdp4bit reduce-scatters (the partitions are fp32, checked against the core); the
    # default (bf16, the model's dtype) is the test above.
    section = {"preset": "sdp4bit", "ranks_per_node": 2, "seed": 3}
    per_rank = run_ranks(4, ds.train, 2, section, 3, 2, True, None, "fp32", env=CPU)
    for losses, _, _, compared in per_rank:
        assert compared == 3, "every step's partitions are compared with the core"
        assert all(torch.isfinite(torch.tensor(losses)))
    assert len({p for _, p, _, _ in per_rank}) == 1, "replicas differ"


@pytest.mark.parametrize("preset", ["qsdp", "global-qsgd", "zeropp"])
def test_other_presets_run_on_zero_2(preset):
    per_rank = run_ranks(2, ds.train, 2, {"preset": preset, "ranks_per_node": 1}, 3, env=CPU)
    assert len({p for _, p, _, _ in per_rank}) == 1


def test_loss_tracks_the_baseline():
    steps = 40
    base = run_ranks(2, ds.train, 2, None, steps, env=CPU)[0][0]
    sdp = run_ranks(2, ds.train, 2, {"preset": "sdp4bit", "ranks_per_node": 1}, steps,
                    env=CPU)[0][0]
    tail = slice(steps - 10, steps)
    base_tail = sum(base[tail]) / 10
    sdp_tail = sum(sdp[tail]) / 10
    assert base_tail < 0.5 * base[0], "the baseline did not learn"
    assert abs(sdp_tail - base_tail) < 0.15 * base_tail, (sdp_tail, base_tail)


@pytest.mark.parametrize("section, fragment", [
    ({"preset": "sdp5bit"}, "is not one of"),
    ({"preset": "sdp4bit", "weight_bitz": 4}, "unknown key(s) ['weight_bitz']"),
    ({"preset": "sdp4bit", "weight_bits": 3}, "weight_bits=3"),
    ({"ranks_per_node": 0}, "ranks_per_node"),
    ({"enabled": "yes"}, "enabled"),
    ({"telemetry_interval": -1}, "telemetry_interval"),
    ({"telemetry_interval": True}, "telemetry_interval"),
    ({"exact_params": "norms-biases-embeddings"},
     "exact_params=norms-biases-embeddings is implemented for megatron-core"),
    ("sdp4bit", "must be an object"),
])
def test_bad_sections_are_rejected(section, fragment):
    with pytest.raises(Sdp4bitError) as error:
        deepspeed_zero.settings_from_config({"sdp4bit": section})
    assert fragment in str(error.value)


@pytest.mark.parametrize("stage, section, fragment", [
    (3, {"preset": "sdp4bit"}, "ZeRO stage 3 frees gathered parameters"),
    (0, {"preset": "sdp4bit"}, "ZeRO stage 0"),
    (2, {"preset": "sdp4bit", "zero": {"offload_optimizer": {"device": "cpu"}}},
     "offload_optimizer to cpu"),
    (3, {"preset": "qsdp", "zero": {"offload_param": {"device": "nvme"}}},
     "offload_param to nvme"),
    (3, {"preset": "qsdp", "zero": {"zero_quantized_weights": True}},
     "ZeRO++'s zero_quantized_weights"),
    (3, {"preset": "qsdp", "zero": {"zero_quantized_gradients": True}},
     "ZeRO++'s zero_quantized_gradients"),
    (3, {"preset": "qsdp", "zero": {"zero_hpz_partition_size": 2}},
     "zero_hpz_partition_size > 1"),
])
def test_stages_it_cannot_serve_are_rejected_before_deepspeed_starts(stage, section, fragment):
    # Refused from the config, before deepspeed.initialize runs: a Linear is no model it could
    # build an engine from on these ranks.
    section = dict(section)
    zero = section.pop("zero", {})
    config = ds._ds_config(stage, 1, section)
    config["zero_optimization"].update(zero)
    with pytest.raises(Sdp4bitError) as error:
        deepspeed_zero.initialize(model=torch.nn.Linear(4, 4), config=config)
    assert fragment in str(error.value)


@pytest.mark.parametrize("stage", [2, 3])
def test_model_parallelism_is_refused(stage):
    # Megatron-DeepSpeed passes an mpu; with TP = 2 its ranks hold copies of parameters that
    # each DP group would compress differently.
    for message in run_ranks(4, ds.model_parallel_refused, stage, env=CPU):
        assert "has a model-parallel group of 2 ranks" in message, message


def test_disabled_section_changes_nothing():
    assert deepspeed_zero.settings_from_config({"sdp4bit": {"enabled": False}}) is None
    assert deepspeed_zero.settings_from_config({}) is None


@pytest.mark.parametrize("stage", [1, 2])
def test_nan_gradient_reaches_the_overflow_check_on_every_rank(stage):
    for skipped, changed in run_ranks(2, ds.nan_skips_the_step, stage, env=CPU):
        assert skipped == 1
        assert not changed


@pytest.mark.parametrize("section", [
    {"preset": "qsdp"},
    {"preset": "sdp4bit", "weight_codec": "qw"},
    {"preset": "zeropp"},
])
def test_zero_3_gathers_with_direct_weight_codecs_and_reduces_with_gradient_codecs(section):
    # W = 4 as 2 nodes x 2 ranks: every on-demand gather leaves all ranks with the same
    # parameters, every gradient bucket's partition equals the core's, the loss falls.
    section = {**section, "ranks_per_node": 2}
    per_rank = run_ranks(4, ds.train_stage3, section, 16, env=CPU)
    for losses, (sent, uncompressed), gathers, reductions in per_rank:
        assert gathers > 0 and reductions > 0
        assert 0 < sent < uncompressed / 2  # 4- or 8-bit codes with group scales
        assert sum(losses[-4:]) < 0.8 * sum(losses[:4]), losses


def test_degraded_route_is_logged_once_at_set_up_and_rank_0_says_sdp4bit_is_on():
    for rank, (messages, deepspeed_lines) in enumerate(run_ranks(3, ds.route_notice, env=CPU)):
        notices = [m for m in messages if "unequal" in m]
        assert len(notices) == 1, messages
        # The start-up line, through DeepSpeed's own logger (log_dist), from rank 0 only.
        started = [m for m in deepspeed_lines if "sdp4bit enabled for " in m]
        assert len(started) == (rank == 0), deepspeed_lines


def test_deepspeeds_own_initialize_compresses_once_installed():
    # As Hugging Face Trainer and Accelerate build the engine: deepspeed.initialize itself.
    for sent, uncompressed in run_ranks(2, ds.plain_initialize, True, env=CPU):
        assert 0 < sent < uncompressed / 2, (sent, uncompressed)
    # The control: without install(), DeepSpeed's own collectives run (nothing through sdp4bit).
    for sent, uncompressed in run_ranks(2, ds.plain_initialize, False, env=CPU):
        assert (sent, uncompressed) == (0, 0)


LAUNCHED = """
import deepspeed
from deepspeed import initialize
import sys
print("wrapped", hasattr(deepspeed.initialize, "sdp4bit_original"),
      initialize is deepspeed.initialize, sys.argv[1:])
"""


def test_the_launcher_prefix_installs_before_the_script_runs(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(LAUNCHED)
    done = subprocess.run([sys.executable, "-m", "sdp4bit.deepspeed", str(script), "--x", "1"],
                          env={**os.environ, **CPU}, cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "wrapped True True ['--x', '1']" in done.stdout, done.stdout
    done = subprocess.run([sys.executable, "-m", "sdp4bit.deepspeed", "missing.py"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and "no training script 'missing.py'" in done.stderr


def test_bytes_reach_deepspeeds_monitor_every_interval(tmp_path):
    # DeepSpeed's csv_monitor, as its tensorboard, wandb and comet writers, gets the events.
    (sent, uncompressed), *_ = run_ranks(2, ds.monitor_telemetry, str(tmp_path), env=CPU)
    rows = {}
    for name in ("bytes_sent", "bytes_uncompressed"):
        lines = (tmp_path / "job" / f"sdp4bit_{name}.csv").read_text().splitlines()
        assert lines[0].split(",")[1] == name, lines  # DeepSpeed's header: step, name
        rows[name] = [(int(step), int(float(value))) for step, value in
                      (line.split(",") for line in lines[1:])]
    # Steps 2, 4 and 6 (x axis: samples, 16 a step on 2 ranks), bytes growing with each.
    assert [s for s, _ in rows["bytes_sent"]] == [32, 64, 96], rows
    assert rows["bytes_sent"][-1][1] == sent and rows["bytes_uncompressed"][-1][1] == uncompressed
    assert all(0 < s < u / 2 for (_, s), (_, u) in zip(rows["bytes_sent"],
                                                      rows["bytes_uncompressed"]))
    assert rows["bytes_sent"][0][1] < rows["bytes_sent"][1][1] < rows["bytes_sent"][2][1]

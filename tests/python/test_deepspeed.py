"""DeepSpeed ZeRO integration on CPU (DS_ACCELERATOR=cpu, gloo): the "sdp4bit" config
section, ZeRO stages 1, 2 and 3."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch

import deepspeed_config_scenarios as dc
import deepspeed_scenarios as ds
from harness import run_ranks
import sdp4bit.deepspeed as deepspeed_zero
from sdp4bit import Sdp4bitError
from sdp4bit.deepspeed import compat

CPU = {"DS_ACCELERATOR": "cpu"}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_baseline_preset_is_bit_exact_with_deepspeeds_own_path(stage):
    own = run_ranks(2, ds.train, stage, None, 4, env=CPU)
    baseline = run_ranks(2, ds.train, stage, {"preset": "baseline"}, 4, env=CPU)
    for (own_losses, own_params, _, _), (losses, params, sent, _) in zip(own, baseline):
        assert losses == own_losses
        assert params == own_params
        assert sent == (0, 0)


# Buckets of at most 5000 elements cut the test model (33 608 parameters) into four, in
# backward order: the last layer's three tensors, then one tensor each; at W = 4 their shards
# straddle DeepSpeed's partitions of 8402 elements.
BUCKETS = {"reduce_bucket_size": 5000}


@pytest.mark.parametrize("stage, overlap", [(1, False), (1, True), (2, False), (2, True)])
def test_sdp4bit_partitions_equal_the_core_and_replicas_stay_identical(stage, overlap):
    # W = 4 as 2 nodes x 2 ranks, two micro-batches per step (ZeRO 2 reduces after each, ZeRO 1
    # at the boundary), an exact all-gather (as when loading a checkpoint) after step 2, which
    # restarts qWD from the gathered weights.
    section = {"preset": "sdp4bit", "ranks_per_node": 2, "seed": 3}
    zero = {**BUCKETS, "overlap_comm": overlap}
    per_rank = run_ranks(4, ds.train, stage, section, 5, 2, True, 2, None, zero, env=CPU)
    for losses, _, (sent, uncompressed), compared in per_rank:
        assert compared == 5, "every step's partitions are compared with the core"
        assert all(torch.isfinite(torch.tensor(losses)))
        # 4-bit weights and gradients with group scales, the two small buckets' shards padded
        # to the codec's unit, plus at each boundary the exact bf16 all-to-all of the shards'
        # pieces that lie in other ranks' partitions (about half of 1/W of the elements here).
        assert 0 < sent < uncompressed / 2, (sent, uncompressed)
    params = {p for _, p, _, _ in per_rank}
    assert len(params) == 1, "replicas differ"


def test_fp32_gradient_accumulation_stays_fp32_on_zero_2():
    # "grad_accum_dtype": "fp32": DeepSpeed keeps fp32 gradient accumulators, and so do the
    # bucket buffers and shard sums sdp4bit keeps (the partitions are fp32, checked against the
    # core); the default (bf16, the model's dtype) is the test above.
    section = {"preset": "sdp4bit", "ranks_per_node": 2, "seed": 3}
    per_rank = run_ranks(4, ds.train, 2, section, 3, 2, True, None, "fp32", BUCKETS, env=CPU)
    for losses, _, _, compared in per_rank:
        assert compared == 3, "every step's partitions are compared with the core"
        assert all(torch.isfinite(torch.tensor(losses)))
    assert len({p for _, p, _, _ in per_rank}) == 1, "replicas differ"


def test_bucketed_reduction_gives_deepspeeds_own_partitions():
    # The same bucket layout and data through DeepSpeed's own ZeRO 2 (bf16 reduce to each
    # piece's owner) and through sdp4bit's buckets, shards and all-to-all with quantization
    # deferred (grad_quant_start_step: the fp32 reduce-scatter): the partitions differ only by
    # rounding. Ours rounds the fp32 sum of W bf16 terms x_j once, |ours - S| <= u |S|; a bf16
    # reduction rounds after each of its W - 1 additions, |own - S| <= (W - 1) u sum|x_j|
    # (to first order), u = 2^-8; so |ours - own| <= W u sum|x_j| per element, with 1% slack
    # for the higher-order terms. The control: 4-bit gradients break that bound.
    world = 4
    own = run_ranks(world, ds.first_partition, None, env=CPU)
    exact = {"preset": "sdp4bit", "ranks_per_node": 2, "grad_quant_start_step": 100}
    ours = run_ranks(world, ds.first_partition, exact, env=CPU)
    quantized = run_ranks(world, ds.first_partition, {**exact, "grad_quant_start_step": 0},
                          env=CPU)
    bound_kept = broken = 0
    for (own_partition, _), (partition, magnitudes), (q_partition, _) in zip(own, ours,
                                                                             quantized):
        own_partition, partition, magnitudes, q_partition = (
            torch.tensor(values) for values in (own_partition, partition, magnitudes,
                                                q_partition))
        padding = own_partition.numel()
        assert partition.numel() >= padding and not partition[padding:].any()
        bound = world * 2.0**-8 * magnitudes[:padding] * 1.01
        assert magnitudes.sum() > 0
        bound_kept += bool(((partition[:padding] - own_partition).abs() <= bound).all())
        broken += bool(((q_partition[:padding] - own_partition).abs() > bound).any())
    assert bound_kept == world, "a partition differs from DeepSpeed's beyond rounding"
    assert broken == world, "the control: quantized gradients should exceed the bound"


@pytest.mark.parametrize("overlap", [True, False])
def test_buckets_reduce_during_the_backward_pass(overlap):
    # The four buckets' reduce-scatters start from DeepSpeed's gradient hooks, before the
    # backward pass ends. With overlap_comm each runs while later gradients are computed, two in
    # flight at most (DeepSpeed's two IPG buffers); without it each completes before the next
    # gradient is taken.
    for events in run_ranks(2, ds.reduction_timeline, overlap, env=CPU):
        starts = [e[1] for e in events if e[0] == "start"]
        assert starts == [0, 1, 2, 3], events
        end = events.index(("epilogue",))
        assert ("start", 3) in events[:end], "the last bucket starts during the backward pass"
        in_flight, most = set(), 0
        for event in events:
            if event[0] == "start":
                in_flight.add(event[1])
            elif event[0] == "wait":
                in_flight.discard(event[1])
            most = max(most, len(in_flight))
        assert most == (2 if overlap else 1), events
        if overlap:
            assert ("wait", 3) in events[end:], "the last bucket is awaited at the epilogue"


def test_zero_2_holds_no_more_memory_than_deepspeeds_own_reduction():
    # Bytes of every tensor Python reaches (W = 4, ZeRO 2, overlap_comm, buckets of one of 16
    # layers) where the backward pass ends and after the step: sdp4bit's store of shard sums
    # and two buckets in flight take the place of DeepSpeed's gradient partition and two IPG
    # buffers, and nothing stays after the step. The control holds a model-sized bf16 gradient
    # buffer (sdp4bit's ZeRO 1/2 path before it reduced by bucket): it is seen, byte for byte,
    # and breaks the comparison.
    section = {"preset": "sdp4bit", "ranks_per_node": 2}
    own = run_ranks(4, ds.memory_held, None, env=CPU)
    ours = run_ranks(4, ds.memory_held, section, env=CPU)
    control = run_ranks(4, ds.memory_held, section, True, env=CPU)
    full = ds.LAYERS * ds.WIDTH**2 * 2
    for own_bytes, our_bytes, control_bytes in zip(own, ours, control):
        for own_at, our_at, control_at in zip(own_bytes, our_bytes, control_bytes):
            assert our_at <= own_at, (our_bytes, own_bytes)
            assert control_at - our_at == full
            assert control_at > own_at


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
    (3, {"preset": "sdp4bit", "weight_codec": "qwd"}, '"sdp4bit.weight_codec": "qwd"'),
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
    section = {"ranks_per_node": 1, **section}
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


def test_the_config_is_read_by_deepspeeds_own_loader(tmp_path):
    # hjson with comments (which json.load rejects), a base64 string and a dict, as
    # deepspeed.initialize takes them; the section parsed from each, the node size checked.
    path = tmp_path / "ds_config.hjson"
    path.write_text(dc.HJSON)
    with pytest.raises(json.JSONDecodeError):
        json.loads(dc.HJSON)
    as_dict = deepspeed_zero.load_config(str(path))
    encoded = base64.urlsafe_b64encode(json.dumps(as_dict).encode()).decode()
    for config in (str(path), encoded, as_dict):
        settings = deepspeed_zero.settings_from_config(deepspeed_zero.load_config(config))
        assert settings.ranks_per_node == 1 and settings.config.resolved.weight_codec == "qwd"
    with pytest.raises(ValueError, match="Expected a string path"):
        deepspeed_zero.load_config(str(tmp_path / "missing.json"))


def test_an_unknown_node_size_is_refused_when_the_section_is_parsed(monkeypatch):
    for name in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE",
                 "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(Sdp4bitError, match='set "sdp4bit": {"ranks_per_node": N}'):
        deepspeed_zero.settings_from_config({"sdp4bit": {"preset": "sdp4bit"}})
    monkeypatch.setenv("LOCAL_SIZE", "4")  # DeepSpeed's launcher
    assert deepspeed_zero.settings_from_config({"sdp4bit": {}}).ranks_per_node == 4


def test_initialize_referenced_before_install_is_handled_or_refused(tmp_path):
    # install() replaces the module-level alias (from deepspeed import initialize as ds_init);
    # the hjson file is read as DeepSpeed reads it; a base64 config without the section runs
    # DeepSpeed's own path; a reference install() cannot reach is refused before DeepSpeed
    # builds anything.
    path = tmp_path / "ds_config.hjson"
    path.write_text(dc.HJSON)
    plain = {k: v for k, v in deepspeed_zero.load_config(str(path)).items() if k != "sdp4bit"}
    encoded = base64.urlsafe_b64encode(json.dumps(plain).encode()).decode()
    for (sent, uncompressed), plain_state, message in run_ranks(
            2, dc.installed_initialize, str(path), encoded, env=CPU):
        assert 0 < sent < uncompressed / 2, (sent, uncompressed)
        assert not plain_state
        assert "taken before sdp4bit.deepspeed.install() ran" in message, message


def test_deepspeed_versions_outside_the_tested_range_are_refused(monkeypatch):
    compat.check_deepspeed_version()  # the installed one
    compat.check_deepspeed_version("0.19.8")
    for version in ("0.19.9", "0.18.0", "0.20.0", "not-a-version"):
        with pytest.raises(Sdp4bitError) as error:
            compat.check_deepspeed_version(version)
        assert f"DeepSpeed {version} is installed" in str(error.value)
        assert compat.TESTED_DEEPSPEED in str(error.value)
    # The package extra declares the same range, and so does the pinned requirement.
    root = Path(__file__).resolve().parents[2]
    extras = tomllib.loads((root / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    assert extras["deepspeed"] == [f"deepspeed{compat.TESTED_DEEPSPEED}"]
    pinned = [line for line in (root / "requirements-deepspeed.txt").read_text().splitlines()
              if line.startswith("deepspeed==")]
    assert compat.check_deepspeed_version(pinned[0].split("==")[1]) is None
    # Checked before DeepSpeed builds anything (a Linear is no engine it could build here).
    import deepspeed

    monkeypatch.setattr(deepspeed, "__version__", "0.18.0")
    with pytest.raises(Sdp4bitError, match="DeepSpeed 0.18.0 is installed"):
        deepspeed_zero.initialize(model=torch.nn.Linear(4, 4),
                                  config=ds._ds_config(2, 1, {"ranks_per_node": 1}))


def test_parameter_alignment_that_pads_parameters_is_refused():
    for message in run_ranks(2, dc.parameter_alignment_refused, env=CPU):
        assert "zero_optimization.parameter_alignment" in message, message


def test_reentrant_checkpointing_gives_the_partitions_of_one_backward_pass():
    # DeepSpeed's epilogue runs once per phase of a reentrant backward pass (3 here). With
    # quantization deferred (the fp32 reduce-scatter: at W = 2 one rounding of a two-term sum,
    # as DeepSpeed's own bf16 reduction) each phase's sums add into the partition the earlier
    # phases handed over: bit for bit the partition of the same batch without checkpointing,
    # which is DeepSpeed's own. The control: each phase's partition replacing the earlier
    # ones' (sdp4bit before) loses the first phases' gradients.
    exact = {"preset": "sdp4bit", "ranks_per_node": 1, "grad_quant_start_step": 100}
    ours = run_ranks(2, dc.reentrant_partitions, exact, env=CPU)
    own = run_ranks(2, dc.reentrant_partitions, None, env=CPU)
    replaced = run_ranks(2, dc.reentrant_partitions, exact, False, env=CPU)
    for ((plain, reentrant), counts), ((own_plain, _), _), ((_, control), _) in zip(
            ours, own, replaced):
        assert counts == [1, 3], counts
        assert torch.equal(torch.tensor(reentrant), torch.tensor(plain))
        assert torch.equal(torch.tensor(reentrant), torch.tensor(own_plain))
        assert not torch.equal(torch.tensor(control), torch.tensor(plain))

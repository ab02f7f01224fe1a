"""The tree's codecs compute, bit for bit, what those of the tree the convergence study ran on
computed (bench/codec_digest.py against bench/results/codec_digest.json), on any machine: the
core's collectives do not depend on the CPU's floating-point kernels. A change to the numerics
fails here; it then needs the study rerun and the digest recorded again."""

import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import codec_digest  # noqa: E402

KEPT = json.loads((ROOT / "bench/results/codec_digest.json").read_text())


def test_every_codec_of_the_study_computes_what_the_studys_tree_computed():
    now = codec_digest.digests()
    assert now.keys() == KEPT["digests"].keys(), "the study's rows changed: rerun the study"
    differ = [case for case in now if now[case] != KEPT["digests"][case]]
    assert not differ, f"these codecs' bytes changed since the study ran: {differ}"
    assert codec_digest.combined(now) == KEPT["all"]


def test_the_digest_sees_a_change_of_the_rounding_seed():
    assert (codec_digest.preset_digest("sdp4bit", {"seed": "8"})
            != KEPT["digests"]["sdp4bit"])


def test_the_digested_shards_are_quantized_not_exact():
    config = codec_digest.Config.from_knobs("sdp4bit", {"seed": "7"})
    inputs = torch.stack([codec_digest._floats(f"control {rank}", codec_digest.NUMEL, 1e-3)
                          for rank in range(len(codec_digest.LABELS))])
    shards = torch.ops.sdp4bit.simulate_grad_reduce_scatter(
        config.spec(), codec_digest.LABELS, codec_digest.BUCKET_ID, 0, inputs)
    exact = inputs.double().sum(0).reshape(shards.shape)
    error = (shards.double() - exact).norm() / exact.norm()
    assert 1e-3 < error < 0.5, error

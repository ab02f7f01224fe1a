"""The pieces of bench/hadamard_real.py on synthetic data: the transform is orthonormal, the
group shape figures are those of known groups, and the analysis sees the mechanism where it
exists (outlier channels: TLq-HS's error well below TLq's) with the same code that reports on
real gradients (the test command runs the whole program in a short smoke form)."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import hadamard_real  # noqa: E402


def test_the_block_hadamard_is_orthonormal_and_its_own_inverse():
    x = torch.randn(4 * 32, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    once = hadamard_real.hadamard_blocks(x, 32)
    assert once.norm().item() == pytest.approx(x.norm().item(), rel=1e-12)
    assert torch.allclose(hadamard_real.hadamard_blocks(once, 32), x, atol=1e-12)
    spike = torch.zeros(32, dtype=torch.float64)
    spike[5] = 1.0  # one outlier spreads evenly over its block
    assert torch.allclose(hadamard_real.hadamard_blocks(spike, 32).abs(),
                          torch.full((32,), 32 ** -0.5, dtype=torch.float64))


def test_group_shape_of_known_groups():
    flat = torch.tensor([1.0, -1.0] * 64)  # one group of 128: peak = RMS, kurtosis -2
    spiky = torch.zeros(128)
    spiky[0] = 1.0  # peak / RMS = sqrt(128), kurtosis 128 - 3
    shape = hadamard_real.group_shape(torch.cat([flat, spiky, torch.zeros(128)]), 128)
    assert shape["crest_median"] == pytest.approx((1 + 128 ** 0.5) / 2)
    assert hadamard_real.group_shape(flat, 128) == pytest.approx(
        {"crest_median": 1.0, "crest_p99": 1.0, "kurtosis_median": -2.0,
         "kurtosis_p99": -2.0})
    assert hadamard_real.group_shape(spiky, 128)["kurtosis_median"] == pytest.approx(125.0)


def test_outlier_channels_scale_two_positions_of_every_group_on_every_rank():
    inputs = torch.ones(2, 256)
    out = hadamard_real.with_outlier_channels(inputs, 20.0)
    scaled = (out == 20.0).nonzero()[:, 1].unique().tolist()
    assert scaled == [3, 67, 131, 195] and (out[0] == out[1]).all()


def _analysed(inputs):
    errors = hadamard_real.reduce_errors(inputs, bucket_id=0, draws=4)
    shape = {"raw": hadamard_real.group_shape(inputs[0], 128),
             "hadamard": hadamard_real.group_shape(
                 hadamard_real.hadamard_blocks(inputs[0], 32), 128)}
    return hadamard_real.summarize([errors], [shape], [inputs.shape[1]])


def test_the_analysis_sees_the_hadamard_lower_the_error_of_outlier_channels():
    gaussian = torch.randn(4, 4 * 4096, generator=torch.Generator().manual_seed(2)) * 1e-3
    with_outliers = _analysed(hadamard_real.with_outlier_channels(gaussian, 20.0))
    assert with_outliers["ratio"] < 0.5, with_outliers["ratio"]
    assert with_outliers["hs_lower_share"] > 0.9
    assert with_outliers["hadamard"]["crest_median"] < 0.5 * with_outliers["raw"]["crest_median"]
    # The control: Gaussian groups have nothing for the transform to spread.
    plain = _analysed(gaussian)
    assert 0.8 < plain["ratio"] < 1.25, plain["ratio"]
    assert plain["tlq"]["rel_l2_half_width"] > 0  # intervals over the draws


def test_the_report_gives_each_seeds_ratio_and_their_interval():
    import argparse

    def figures(ratio):
        error = {"rel_l2": 0.1, "rel_l2_half_width": 0.001, "group_nmse_median": 0.01,
                 "group_nmse_p99": 0.1}
        shape = {"crest_median": 3.0, "crest_p99": 4.0, "kurtosis_median": 0.0,
                 "kurtosis_p99": 1.0}
        return {"tlq": error, "tlq-hs": error, "ratio": ratio, "hs_lower_share": 0.5,
                "raw": shape, "hadamard": shape}

    by_seed = {"1": {"50": {"as trained": figures(0.90)}},
               "2": {"50": {"as trained": figures(0.94)}}}
    args = argparse.Namespace(steps=400, dump_steps=[50], draws=32, seeds=[1, 2])
    text = hadamard_real.report(args, by_seed, "now")
    assert "| 50 | as trained | 0.900, 0.940 | 0.920 ± 0.254 |" in text  # t(0.975, 1) = 12.706
    assert text.count("| 50 | as trained |") == 2  # seed 1's detail row, then the seeds' row

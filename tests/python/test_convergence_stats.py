"""The convergence study's statistics (bench/convergence_stats.py) against closed forms."""

import math
import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from convergence_stats import interval, paired_difference, seeds_for_width, t_quantile  # noqa: E402


def test_t_quantile_matches_the_closed_forms_for_one_and_two_degrees_of_freedom():
    for p in (0.9, 0.975, 0.995):
        # df = 1 is the Cauchy distribution; df = 2 has F^-1(p) = (2p - 1) / sqrt(2p(1 - p)).
        assert t_quantile(p, 1) == pytest.approx(math.tan(math.pi * (p - 0.5)), rel=1e-6)
        assert t_quantile(p, 2) == pytest.approx((2 * p - 1) / math.sqrt(2 * p * (1 - p)),
                                                 rel=1e-6)


def test_t_quantile_approaches_the_normal_one_and_refuses_bad_arguments():
    assert 1.959964 < t_quantile(0.975, 2000) < 1.9612
    with pytest.raises(ValueError, match="t quantile"):
        t_quantile(0.4, 3)
    with pytest.raises(ValueError, match="t quantile"):
        t_quantile(0.975, 0)


def test_interval_covers_the_true_mean_95_percent_of_the_time():
    rng = random.Random(7)
    trials, covered = 4000, 0
    for _ in range(trials):
        got = interval([rng.gauss(1.5, 0.3) for _ in range(3)])
        covered += got.low <= 1.5 <= got.high
    # Binomial(4000, 0.95): standard deviation 0.0034; five of them either side.
    assert abs(covered / trials - 0.95) < 5 * math.sqrt(0.95 * 0.05 / trials)


def test_paired_difference_is_taken_seed_by_seed():
    base = {1: 2.0, 2: 3.0, 3: 4.0}
    row = {1: 2.1, 2: 3.1, 3: 4.1}  # far apart across seeds, a constant +0.1 within each
    diff = paired_difference(row, base)
    assert diff.mean == pytest.approx(0.1) and diff.half_width == pytest.approx(0.0, abs=1e-12)
    assert math.isnan(interval([1.0]).half_width)
    # Over the row's seeds only: a baseline with more seeds pairs with the ones the row has.
    assert paired_difference({1: 2.3, 3: 4.1}, base).mean == pytest.approx(0.2)
    with pytest.raises(ValueError, match=r"the baseline lacks seeds \[4\]"):
        paired_difference({1: 2.0, 4: 1.0}, base)


def _full_width(spread: float, n: int) -> float:
    return 2 * t_quantile(0.975, n - 1) * spread / math.sqrt(n)


def test_seeds_for_width_is_the_fewest_seeds_whose_interval_is_narrow_enough():
    # t(0.975, 5) / sqrt(6) = 1.0497 and t(0.975, 6) / sqrt(7) = 0.9248: 7 seeds for 2 spreads.
    assert seeds_for_width(1.0, 2.0) == 7
    for spread, width in ((0.0051, 0.0094), (0.012, 0.0094), (0.3, 0.05)):
        n = seeds_for_width(spread, width)
        assert _full_width(spread, n) < width <= _full_width(spread, n - 1) or n == 2
    assert seeds_for_width(0.0, 0.01) == 2
    with pytest.raises(ValueError, match="width > 0"):
        seeds_for_width(0.01, 0.0)


def _paired_draws(rng, n, mean, spread):
    return [rng.gauss(mean, spread) for _ in range(n)]


def test_seeds_for_non_inferiority_gives_the_power_asked_for():
    from convergence_stats import seeds_for_non_inferiority, upper_bound

    rng = random.Random(11)
    spread, margin = 0.005, 0.0025
    n = seeds_for_non_inferiority(spread, margin, 0.8)
    assert n == 27  # (1.645 + 0.842)^2 (0.005 / 0.0025)^2 = 24.7, plus the t's heavier tails
    trials = 4000
    shown = sum(upper_bound(_paired_draws(rng, n, 0.0, spread)) < margin for _ in range(trials))
    fewer = sum(upper_bound(_paired_draws(rng, n - 8, 0.0, spread)) < margin
                for _ in range(trials))
    assert 0.77 < shown / trials < 0.85  # binomial sd 0.006 at 4000 trials
    assert fewer / trials < 0.72  # the control: 8 seeds fewer fall clearly short
    with pytest.raises(ValueError):
        seeds_for_non_inferiority(0.005, 0.0, 0.8)


def test_upper_bound_covers_the_mean_at_the_confidence_asked_for():
    from convergence_stats import upper_bound

    rng = random.Random(5)
    trials = 20000
    draws = [_paired_draws(rng, 15, 0.0, 1.0) for _ in range(trials)]
    # Misses (a bound under the true mean, 0) at 1 - confidence: binomial sd 0.0008 at 1.25%.
    corrected = sum(upper_bound(d, 1 - 0.05 / 4) < 0.0 for d in draws) / trials
    assert 0.0095 < corrected < 0.0155
    plain = sum(upper_bound(d) < 0.0 for d in draws) / trials  # the default, 95%
    assert 0.045 < plain < 0.055
    assert math.isnan(upper_bound([1.0], 0.99))


def test_power_to_detect_matches_simulated_intervals():
    from convergence_stats import interval, power_to_detect, t_cdf

    assert t_cdf(-1.0, 3) == pytest.approx(0.19550, abs=1e-4)  # tables' value
    rng = random.Random(12)
    trials = 4000
    for effect, n in ((0.005, 10), (0.0025, 19), (0.0, 10)):
        seen = sum(interval(_paired_draws(rng, n, effect, 0.005)).low > 0
                   for _ in range(trials)) / trials
        assert seen == pytest.approx(power_to_detect(effect, 0.005, n), abs=0.03), (effect, n)

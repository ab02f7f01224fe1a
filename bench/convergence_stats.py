"""Statistics of the convergence study: means with Student-t 95% intervals over seeds, and
paired differences (the same seed: the same initial weights, data order and random streams)
from the baseline row."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass


def _t_density(x: float, df: int) -> float:
    log_norm = (math.lgamma((df + 1) / 2) - math.lgamma(df / 2)
                - 0.5 * math.log(df * math.pi))
    return math.exp(log_norm - (df + 1) / 2 * math.log1p(x * x / df))


def _t_cdf_above_zero(x: float, df: int, panels: int = 2000) -> float:
    """P(0 < T < x) for Student's t with `df` degrees of freedom (Simpson's rule)."""
    h = x / panels
    total = _t_density(0.0, df) + _t_density(x, df)
    for i in range(1, panels):
        total += (4 if i % 2 else 2) * _t_density(i * h, df)
    return total * h / 3


@functools.lru_cache(maxsize=None)
def t_quantile(probability: float, df: int) -> float:
    """The `probability` quantile (above 0.5) of Student's t with `df` degrees of freedom, by
    bisection on its distribution function; 12.706 for 0.975 and df = 1."""
    if not 0.5 < probability < 1 or df < 1:
        raise ValueError(f"t quantile needs 0.5 < p < 1 and df >= 1, got {probability}, {df}")
    low, high = 0.0, 1.0
    while 0.5 + _t_cdf_above_zero(high, df) < probability:
        low, high = high, high * 2
    for _ in range(60):
        mid = (low + high) / 2
        if 0.5 + _t_cdf_above_zero(mid, df) < probability:
            low = mid
        else:
            high = mid
    return (low + high) / 2


@dataclass(frozen=True)
class Interval:
    """A mean over `n` samples and the half-width of its 95% Student-t interval (NaN with
    fewer than two samples)."""

    mean: float
    half_width: float
    n: int

    @property
    def low(self) -> float:
        return self.mean - self.half_width

    @property
    def high(self) -> float:
        return self.mean + self.half_width

    def format(self, digits: int = 4) -> str:
        if math.isnan(self.half_width):
            return f"{self.mean:+.{digits}f}"
        return f"{self.mean:+.{digits}f} ± {self.half_width:.{digits}f}"


def _standard_error(samples: list[float], mean: float) -> float:
    """The standard error of the mean of `samples` (n - 1 in the variance; n >= 2)."""
    n = len(samples)
    return math.sqrt(sum((x - mean) ** 2 for x in samples) / (n - 1) / n)


def interval(samples: list[float]) -> Interval:
    """The mean of `samples` with its 95% interval (Student t, n - 1 degrees of freedom)."""
    n = len(samples)
    if n == 0:
        raise ValueError("an interval needs at least one sample")
    mean = sum(samples) / n
    if n < 2:
        return Interval(mean, math.nan, n)
    return Interval(mean, t_quantile(0.975, n - 1) * _standard_error(samples, mean), n)


def upper_bound(samples: list[float], confidence: float = 0.95) -> float:
    """The one-sided upper confidence bound of the mean of `samples` at `confidence` (Student
    t, n - 1 degrees of freedom): the mean plus t(confidence, n - 1) standard errors; NaN below
    two samples."""
    n = len(samples)
    if n < 2:
        return math.nan
    mean = sum(samples) / n
    return mean + t_quantile(confidence, n - 1) * _standard_error(samples, mean)


def paired_difference(row: dict[int, float], baseline: dict[int, float]) -> Interval:
    """The mean over the row's seeds of row - baseline, seed by seed, with its 95% interval;
    the baseline must hold every seed of the row (it may hold more)."""
    missing = sorted(set(row) - set(baseline))
    if missing:
        raise ValueError(f"the baseline lacks seeds {missing} of the row's {sorted(row)}")
    return interval([row[seed] - baseline[seed] for seed in sorted(row)])


def seeds_for_width(spread: float, width: float) -> int:
    """The fewest seeds (at least 2) for which the 95% interval of paired differences whose
    standard deviation is `spread` has a full width, 2 t(0.975, n - 1) spread / sqrt(n), under
    `width`."""
    if spread < 0 or width <= 0:
        raise ValueError(f"seeds_for_width needs spread >= 0 and width > 0, got {spread}, {width}")
    # t(0.975, n - 1) > 1.959964 (the normal quantile), so no n below this bound can do.
    n = max(2, math.floor((2 * 1.959964 * spread / width) ** 2))
    while 2 * t_quantile(0.975, n - 1) * spread / math.sqrt(n) >= width:
        n += 1
    return n


def t_cdf(x: float, df: int) -> float:
    """P(T < x) for Student's t with `df` degrees of freedom."""
    inside = _t_cdf_above_zero(abs(x), df)
    return 0.5 + inside if x >= 0 else 0.5 - inside


def seeds_for_non_inferiority(spread: float, margin: float, power: float = 0.8) -> int:
    """The fewest seeds (at least 2) at which a row truly equal to its reference has
    probability `power` of a one-sided 95% upper bound under `margin`, when its paired
    differences have standard deviation `spread`: n with (t(0.95, n - 1) + t(power, n - 1))
    spread / sqrt(n) <= margin (the shifted-t approximation of the noncentral t)."""
    if spread < 0 or margin <= 0 or not 0.5 < power < 1:
        raise ValueError(f"seeds_for_non_inferiority needs spread >= 0, margin > 0 and "
                         f"0.5 < power < 1, got {spread}, {margin}, {power}")
    n = 2
    while ((t_quantile(0.95, n - 1) + t_quantile(power, n - 1)) * spread / math.sqrt(n)
           > margin):
        n += 1
    return n


def power_to_detect(effect: float, spread: float, n: int) -> float:
    """The probability that n paired seeds whose differences have mean `effect` and standard
    deviation `spread` give a two-sided 95% interval above zero (the shifted-t
    approximation)."""
    if n < 2 or spread <= 0:
        raise ValueError(f"power_to_detect needs n >= 2 and spread > 0, got {n}, {spread}")
    return 1.0 - t_cdf(t_quantile(0.975, n - 1) - effect * math.sqrt(n) / spread, n - 1)

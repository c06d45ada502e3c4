"""Open-loop send times: seeded exponential gaps whose mean rate is the one asked for."""

from __future__ import annotations

import pytest

from services.bench.arrivals import poisson_arrivals


def test_seeded_and_increasing():
    first = poisson_arrivals(100, 4.0, seed=1)
    assert first == poisson_arrivals(100, 4.0, seed=1)
    assert first != poisson_arrivals(100, 4.0, seed=2)
    assert all(b > a for a, b in zip(first, first[1:]))
    assert first[0] > 0


@pytest.mark.parametrize("rate", [0.5, 2.0, 8.0, 100.0])
def test_mean_rate_within_tolerance(rate):
    n = 20_000
    times = poisson_arrivals(n, rate, seed=3)
    assert n / times[-1] == pytest.approx(rate, rel=0.03)  # sd of the mean gap ~ 1/sqrt(n)
    gaps = [b - a for a, b in zip([0.0, *times], times)]
    mean = sum(gaps) / n
    variance = sum((g - mean) ** 2 for g in gaps) / n
    assert variance**0.5 == pytest.approx(mean, rel=0.05)  # exponential: sd equals mean


def test_rate_must_be_positive():
    with pytest.raises(ValueError):
        poisson_arrivals(3, 0.0, seed=0)

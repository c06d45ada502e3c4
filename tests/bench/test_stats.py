"""Percentiles by linear interpolation between closest ranks (numpy's default)."""

from __future__ import annotations

import math
import random

import pytest

from services.bench.stats import Summary, percentile


def test_known_values():
    values = [15, 20, 35, 40, 50]
    assert percentile(values, 0) == 15
    assert percentile(values, 100) == 50
    assert percentile(values, 50) == 35  # odd count: the middle value
    assert percentile(values, 40) == pytest.approx(29.0)  # rank 1.6: 20 + 0.6 * 15
    assert percentile(values, 90) == pytest.approx(46.0)  # rank 3.6: 40 + 0.6 * 10


def test_even_count_median_is_the_mean_of_the_middle_two():
    assert percentile([4, 1, 3, 2], 50) == 2.5  # order of input does not matter


def test_one_to_hundred():
    values = list(range(1, 101))
    assert percentile(values, 50) == pytest.approx(50.5)
    assert percentile(values, 90) == pytest.approx(90.1)
    assert percentile(values, 99) == pytest.approx(99.01)


def test_matches_numpy_default():
    numpy = pytest.importorskip("numpy")
    rng = random.Random(7)
    for n in (1, 2, 3, 10, 101):
        values = [rng.expovariate(1.0) for _ in range(n)]
        for p in (0, 1, 50, 90, 99, 100):
            assert percentile(values, p) == pytest.approx(float(numpy.percentile(values, p)))


def test_edges():
    assert percentile([3.0], 99) == 3.0
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_summary_is_ordered_and_in_ms():
    summary = Summary.of([0.010, 0.020, 0.030, 0.040, 1.0])
    assert summary.count == 5
    assert summary.p50 <= summary.p90 <= summary.p99 <= summary.max == 1.0
    as_ms = summary.as_ms()
    assert as_ms["p50_ms"] == 30.0 and as_ms["max_ms"] == 1000.0
    assert Summary.of([]).as_ms()["p50_ms"] is None

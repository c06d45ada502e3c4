"""Percentiles and latency summaries: pure functions over lists of seconds.

Percentile definition (the one numpy.percentile uses by default, "linear", Hyndman & Fan type 7):
sort the n values x[0] <= ... <= x[n-1]; the p-th percentile sits at fractional rank
r = (n - 1) * p / 100 and is x[floor(r)] + (r - floor(r)) * (x[floor(r) + 1] - x[floor(r)]).
So p0 is the minimum, p100 the maximum, p50 of an even count the mean of the two middle values,
and every percentile lies between two observed values (monotone in p)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

PERCENTILES = (50, 90, 99)


def percentile(values: Sequence[float], p: float) -> float:
    """The p-th percentile (0 <= p <= 100) of `values` by linear interpolation; NaN if empty."""
    if not 0 <= p <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {p}")
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * p / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (rank - low) * (ordered[high] - ordered[low])


@dataclass(frozen=True)
class Summary:
    """Distribution of one latency, in seconds."""

    count: int  # number of observations
    mean: float
    p50: float
    p90: float
    p99: float
    max: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Summary:
        if not values:
            return cls(0, math.nan, math.nan, math.nan, math.nan, math.nan)
        return cls(
            count=len(values),
            mean=sum(values) / len(values),
            p50=percentile(values, 50),
            p90=percentile(values, 90),
            p99=percentile(values, 99),
            max=max(values),
        )

    def as_ms(self) -> dict[str, float | int | None]:
        """JSON-ready, milliseconds rounded to 0.01 ms; NaN becomes None."""

        def ms(value: float) -> float | None:
            return None if math.isnan(value) else round(value * 1000, 2)

        return {
            "count": self.count,
            "mean_ms": ms(self.mean),
            "p50_ms": ms(self.p50),
            "p90_ms": ms(self.p90),
            "p99_ms": ms(self.p99),
            "max_ms": ms(self.max),
        }

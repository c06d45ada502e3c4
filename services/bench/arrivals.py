"""When each request of an open-loop run is sent: a Poisson process, i.e. independent
exponential inter-arrival times with mean 1/rate, from a seeded generator."""

from __future__ import annotations

import random


def poisson_arrivals(num_requests: int, rate: float, seed: int) -> list[float]:
    """Send times in seconds from the start (the first request at its first gap, not at 0);
    `rate` in requests/s; the same seed gives the same times."""
    if rate <= 0:
        raise ValueError(f"request rate must be positive, got {rate}")
    rng = random.Random(seed)
    times, now = [], 0.0
    for _ in range(num_requests):
        now += rng.expovariate(rate)
        times.append(now)
    return times

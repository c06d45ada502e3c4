"""LLM.int8() layers run once per request, so a request's output does not depend on its batch.

bitsandbytes' int8 matmul (threshold > 0) picks its outlier columns over the whole input: a
column in which any row exceeds the threshold is computed in floating point for every row.
With several requests packed into one forward pass, one request's activations would change
another's result, and greedy output would depend on who shared the step. Wrapping each
`Linear8bitLt` so it runs one request's rows at a time makes the outlier decision per request,
as transformers makes it when it runs that request alone.

The runner owns one `RowSegments` and sets its bounds around each forward pass:

    packed rows:  | r0: 5 prompt tokens | r1: 1 decode | r2: chunk of 3 |
    bounds:       0                     5              6                9
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

import torch

log = logging.getLogger(__name__)


class RowSegments:
    """The packed row offsets of each request in the forward pass under way."""

    def __init__(self) -> None:
        self.bounds: list[int] | None = None  # [num_requests + 1] row offsets; None: one segment

    @contextmanager
    def active(self, bounds: list[int]) -> Iterator[None]:
        self.bounds = bounds
        try:
            yield
        finally:
            self.bounds = None


def _is_outlier_int8(module: torch.nn.Module) -> bool:
    state = getattr(module, "state", None)
    return type(module).__name__ == "Linear8bitLt" and getattr(state, "threshold", 0.0) > 0.0


def isolate_int8_rows(model: torch.nn.Module | None) -> RowSegments | None:
    """Make every outlier-decomposing int8 layer of `model` run per request; None if it has
    none (or no model at all: the simulated worker)."""
    segments = RowSegments()
    layers = [m for m in model.modules() if _is_outlier_int8(m)] if model is not None else []
    for module in layers:
        module.forward = _per_segment(module.forward, segments)
    if not layers:
        return None
    log.info("%d LLM.int8() layers run once per request (batch-independent outliers)", len(layers))
    return segments


def _per_segment(forward, segments: RowSegments):
    def run(x: torch.Tensor) -> torch.Tensor:  # x: [1, num_tokens, in_features]
        bounds = segments.bounds
        if bounds is None or len(bounds) <= 2:
            return forward(x)
        parts = [forward(x[:, start:end]) for start, end in zip(bounds, bounds[1:]) if end > start]
        return torch.cat(parts, dim=1)  # [1, num_tokens, out_features]

    return run

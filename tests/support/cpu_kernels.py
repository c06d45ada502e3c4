"""The CPU kernels built afresh for a test, as a worker started with other settings builds them."""

from __future__ import annotations

import pytest

from services.worker import kernels


def build(**env: str) -> kernels.CpuKernels:
    """The CPU kernels built afresh (not load()'s cached ones) with these environment variables
    set: ATEN_CPU_CAPABILITY caps the level, TEXTGEN_BF16_MATMUL picks the bfloat16 multiply."""
    with pytest.MonkeyPatch.context() as patch:
        for name, value in env.items():
            patch.setenv(name, value)
        built = kernels.load.__wrapped__()
    assert built is not None, "the CPU kernels did not build (is a C compiler installed?)"
    return built

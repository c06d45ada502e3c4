"""Fixtures of the worker's tests."""

from __future__ import annotations

import pytest

from services.worker import kernels


@pytest.fixture(scope="session")
def ops() -> kernels.CpuKernels:
    """The CPU kernels, built for this host (capped by ATEN_CPU_CAPABILITY)."""
    built = kernels.load()
    assert built is not None, "the CPU kernels did not build (is a C compiler installed?)"
    return built

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


@pytest.fixture(scope="session")
def avx2_ops() -> kernels.CpuKernels:
    """The CPU kernels built for the avx2 level (as ATEN_CPU_CAPABILITY=avx2 builds them), on
    any x86-64 host with AVX2: its own kernels (the float32 matmul) are tested on AVX512 hosts
    too."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(kernels.CAPABILITY_ENV, "avx2")
        built = kernels.load.__wrapped__()
    assert built is not None, "the CPU kernels did not build (is a C compiler installed?)"
    if built.level != "avx2":  # the cap cannot raise a CPU without AVX2 (or off x86-64)
        pytest.skip(f"no avx2 level on this CPU (the kernels build for {built.level})")
    return built

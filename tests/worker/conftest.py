"""Fixtures of the worker's tests."""

from __future__ import annotations

import pytest

from services.worker import kernels
from services.worker.kernels.matmul import BF16_MATMUL_ENV


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


@pytest.fixture(scope="session", params=["dot", "widen"])
def bf16_ops(request, ops) -> kernels.CpuKernels:
    """The kernels of this host's level, their AVX512-BF16 matmul multiplying each way (dot
    products, FMAs of widened weights) where the level builds it, whichever is faster here;
    elsewhere (AMX tiles, oneDNN) the host's kernels once."""
    if not ops.matmul.has_bf16_dot:
        if request.param == "widen":
            pytest.skip(f"no AVX512-BF16 matmul at the {ops.level} level")
        return ops
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(BF16_MATMUL_ENV, request.param)
        built = kernels.load.__wrapped__()
    assert built is not None and built.matmul.bf16_widens == (request.param == "widen")
    return built

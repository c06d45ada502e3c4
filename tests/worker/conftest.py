"""Fixtures of the worker's tests."""

from __future__ import annotations

import ctypes

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


@pytest.fixture(scope="session")
def no_avx512_bf16_ops(ops, tmp_path_factory) -> kernels.CpuKernels:
    """The kernels of this host's AVX512 level built without AVX512-BF16 (-mno-avx512bf16), as
    a Skylake-SP or an Ice Lake builds them: their bfloat16 matmul widens, as no dot products
    are built, and rounds without vcvtne2ps2bf16. Skipped below the avx512 level."""
    if ops.level not in ("avx512", "amx"):
        pytest.skip(f"no AVX512 at the {ops.level} level")
    library = tmp_path_factory.mktemp("no-avx512-bf16") / "cpu_kernels.so"
    compiler = kernels._compiler()
    assert compiler is not None
    kernels._build(compiler, ops.level, library, extra_flags=("-mno-avx512bf16",))
    built = kernels.CpuKernels(ctypes.CDLL(str(library)), ops.level)
    assert built.matmul.has_bf16_avx512 and not built.matmul.has_bf16_dot_products
    assert built.matmul.bf16_widens and not built.matmul.has_amx
    return built


@pytest.fixture(scope="session", params=["dot", "widen", "no-avx512-bf16"])
def bf16_ops(request, ops) -> kernels.CpuKernels:
    """The kernels of this host's level, their AVX512 bfloat16 matmul multiplying each way it
    is built for (dot products where AVX512-BF16 is, FMAs of widened weights), whichever is
    faster here, and that of a build without AVX512-BF16 (no_avx512_bf16_ops); where this
    level has no such kernel (AMX tiles, oneDNN), the host's kernels once."""
    if request.param == "no-avx512-bf16":
        return request.getfixturevalue("no_avx512_bf16_ops")
    if not ops.matmul.has_bf16_avx512:
        if request.param == "widen":
            pytest.skip(f"no AVX512 bfloat16 matmul at the {ops.level} level")
        return ops
    if request.param == "dot" and not ops.matmul.has_bf16_dot_products:
        pytest.skip("no AVX512-BF16 dot products at this level")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(BF16_MATMUL_ENV, request.param)
        built = kernels.load.__wrapped__()
    assert built is not None and built.matmul.bf16_widens == (request.param == "widen")
    return built

"""Fixtures of the worker's tests."""

from __future__ import annotations

import ctypes

import pytest

from services.worker import kernels
from services.worker.kernels.matmul import BF16_MATMUL_ENV
from tests.support.cpu_kernels import build


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
    built = build(**{kernels.CAPABILITY_ENV: "avx2"})
    if built.level != "avx2":  # the cap cannot raise a CPU without AVX2 (or off x86-64)
        pytest.skip(f"no avx2 level on this CPU (the kernels build for {built.level})")
    return built


@pytest.fixture(scope="session")
def avx512_ops(ops) -> kernels.CpuKernels:
    """The CPU kernels of the avx512 level: this host's, or on an AMX host those built capped to
    it (as ATEN_CPU_CAPABILITY=avx512 builds them), whose AVX512 bfloat16 matmul and prompt
    attention serve the CPUs without tiles (a Zen 4, a Xeon whose hypervisor hides AMX): tested
    on AMX hosts too. Skipped below the avx512 level."""
    if ops.level == "avx512":
        return ops
    if ops.level != "amx":
        pytest.skip(f"no AVX512 at the {ops.level} level")
    built = build(**{kernels.CAPABILITY_ENV: "avx512"})
    assert built.level == "avx512" and not built.matmul.has_amx
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
    faster here, and that of a build without AVX512-BF16 (no_avx512_bf16_ops). Where this level
    has no such kernel, the host's own (AMX tiles, oneDNN) in place of the dot products, and on
    an AMX host the widened FMAs of the avx512 level (avx512_ops) in their place."""
    if request.param == "no-avx512-bf16":
        return request.getfixturevalue("no_avx512_bf16_ops")
    base = ops
    if not ops.matmul.has_bf16_avx512:
        if request.param == "dot":
            return ops
        base = request.getfixturevalue("avx512_ops")  # skipped below the avx512 level
    if request.param == "dot" and not base.matmul.has_bf16_dot_products:
        pytest.skip("no AVX512-BF16 dot products at this level")
    built = build(**{kernels.CAPABILITY_ENV: base.level, BF16_MATMUL_ENV: request.param})
    assert built.level == base.level and built.matmul.bf16_widens == (request.param == "widen")
    return built

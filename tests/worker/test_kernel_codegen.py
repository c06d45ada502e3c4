"""The kernels' FMA loops (matmuls, attention, norms) keep their sums in registers, at every
instruction set the kernels are built for (services/worker/kernels).

A loop that reads its accumulators with a variable index elsewhere in the function can make
GCC keep them in memory as well, storing every one after each FMA: the AVX2 float32 matmul
ran 2.3x slower on Zen 3 that way for a day (its fused gate/up epilogue did it), while the
AVX512 builds that were timed kept their sums in registers. Speed belongs in benchmarks; this
checks the cause in the compiled code, the same on any host (each -march is given, not the
host's). A handful of spills under register pressure are normal (6 rows x 2 sums + 3 on
AVX2's 16 registers); the bug stored ~250."""

from __future__ import annotations

import platform
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from services.worker import kernels

# the flags of each of kernels.LEVELS but default, with a CPU of that kind for the levels that
# build for the host's own (-march=native): with AVX512-BF16 or without, with AMX
MARCHES = {
    "avx2": [kernels.march("avx2")],
    "avx512": [*kernels.LEVEL_FLAGS["avx512"], "-march=x86-64-v4"],
    "avx512-bf16": [*kernels.LEVEL_FLAGS["avx512"], "-march=x86-64-v4", "-mavx512bf16"],
    "amx": [*kernels.LEVEL_FLAGS["amx"], "-march=sapphirerapids"],
}
MAX_SPILLED_SUMS = 16  # FMA results stored to the stack right after, per function
FMA = re.compile(r"\s(vfmadd\w*|vdpbf16ps)\s.*,\s*(%[xyz]mm\d+)$")


def spilled_sums(assembly: str) -> dict[str, int]:
    """Per function: FMAs (or bfloat16 dot products) whose result is stored to the stack
    within the next three instructions."""
    lines = assembly.splitlines()
    counts: dict[str, int] = {}
    function = ""
    for index, line in enumerate(lines):
        label = re.match(r"^([A-Za-z_][\w.]*):", line)
        if label:
            function = label.group(1)
            continue
        fma = FMA.search(line)
        if fma is None:
            continue
        store = re.compile(rf"vmov(aps|ups)\s+{re.escape(fma.group(2))},\s*-?\d*\(%rsp\)")
        if any(store.search(after) for after in lines[index + 1 : index + 4]):
            counts[function] = counts.get(function, 0) + 1
    return counts


def compile_to_assembly(sources: Path, flags: list[str]) -> str:
    compiler = kernels._compiler()
    if compiler is None or platform.machine() != "x86_64":
        pytest.skip("needs a C compiler for x86-64")
    argv = [compiler, *kernels.FLAGS, *flags, "-S", "-o", "-", str(sources / "cpu_kernels.c")]
    argv.remove("-shared")
    result = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    if result.returncode != 0 and "march" in result.stderr:
        pytest.skip(f"this compiler lacks {' '.join(flags)}")
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


@pytest.mark.parametrize("level", list(MARCHES))
def test_fma_loops_keep_their_sums_in_registers(level):
    counts = spilled_sums(compile_to_assembly(kernels.SOURCE_DIR, MARCHES[level]))
    assert all(count <= MAX_SPILLED_SUMS for count in counts.values()), counts


# the AVX2 block's fused gate/up epilogue as it was before the fix: sums[r] read in a row loop
# GCC does not unroll (its body computes the activation)
FIXED_EPILOGUE = """        float both[F32_BLOCK_ROWS][F32_PANEL];
#pragma GCC unroll 16
        for (int r = 0; r < rows; r++) {
            _mm256_storeu_ps(both[r], sums[r][0]);
            _mm256_storeu_ps(both[r] + 8, sums[r][1]);
        }
        for (int r = 0; r < rows; r++) silu_span_f32(both[r], both[r] + 8, out + r * out_stride, 8);
"""
BROKEN_EPILOGUE = """        for (int r = 0; r < rows; r++) {
            float gate[8], up[8];
            _mm256_storeu_ps(gate, sums[r][0]);
            _mm256_storeu_ps(up, sums[r][1]);
            silu_span_f32(gate, up, out + r * out_stride, 8);
        }
"""


def test_the_check_sees_sums_kept_in_memory(tmp_path):
    sources = tmp_path / "kernels"
    shutil.copytree(kernels.SOURCE_DIR, sources, ignore=shutil.ignore_patterns("*.py", "__*"))
    matmul = sources / "f32_linear.inc"
    text = matmul.read_text()
    assert FIXED_EPILOGUE in text  # this test follows the epilogue's text
    matmul.write_text(text.replace(FIXED_EPILOGUE, BROKEN_EPILOGUE))
    counts = spilled_sums(compile_to_assembly(sources, MARCHES["avx2"]))
    assert max(counts.values()) > 100

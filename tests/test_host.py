"""The CPU description that kernel choices and benchmark reports read from /proc/cpuinfo."""

from __future__ import annotations

from shared.host import cpu_flags, describe_cpu

# two processors of a Xeon whose hypervisor hides AVX512-BF16 and AMX (abridged)
XEON = """processor\t: 0
vendor_id\t: GenuineIntel
cpu family\t: 6
model\t\t: 207
model name\t: Intel(R) Xeon(R) Processor
flags\t\t: fpu sse2 avx avx2 fma avx512f avx512bw avx512_vnni

processor\t: 1
vendor_id\t: GenuineIntel
cpu family\t: 6
model\t\t: 207
model name\t: Intel(R) Xeon(R) Processor
flags\t\t: fpu sse2 avx avx2 fma avx512f avx512bw avx512_vnni amx_tile
"""


def test_the_first_processor_is_described():
    cpu = describe_cpu(XEON, num_cpus=2)
    assert (cpu.model_name, cpu.family, cpu.model, cpu.num_cpus) == (
        "Intel(R) Xeon(R) Processor",
        "6",
        "207",
        2,
    )
    assert cpu.has == ["avx2", "avx512f"]
    assert cpu.lacks == ["avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16"]
    assert cpu.line() == (
        "Intel(R) Xeon(R) Processor (family 6 model 207), 2 CPUs: avx2 avx512f; "
        "no avx512_bf16 avx512_fp16 amx_tile amx_bf16"
    )
    assert cpu_flags(XEON) == {
        "fpu",
        "sse2",
        "avx",
        "avx2",
        "fma",
        "avx512f",
        "avx512bw",
        "avx512_vnni",
    }


def test_an_unknown_cpu_claims_nothing():
    cpu = describe_cpu("", num_cpus=1)
    assert (cpu.model_name, cpu.has, cpu.lacks) == ("unknown", [], [])
    assert cpu.line() == "unknown (family ? model ?), 1 CPUs"
    assert cpu_flags("") == set()


def test_this_machine_is_read():
    flags = cpu_flags()
    with open("/proc/cpuinfo") as cpuinfo:
        assert ("flags" in cpuinfo.read()) == bool(flags)
    cpu = describe_cpu()
    assert cpu.num_cpus >= 1 and set(cpu.has) <= flags and set(cpu.has).isdisjoint(cpu.lacks)

"""The machine a process runs on, as kernel choices and benchmark reports need it: the CPU's
model and instruction sets (Linux /proc/cpuinfo) and the CPUs this process may use."""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass

CPUINFO = "/proc/cpuinfo"
# the instruction sets that choose the CPU kernels' code (services/worker/kernels), in order
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16")


def _first_processor(text: str | None) -> dict[str, str]:
    """The first processor's `key: value` lines of a /proc/cpuinfo text (this machine's when
    None, read up to its first processor's end; empty where there is none)."""
    if text is not None:
        return _fields(text.splitlines())
    try:
        with open(CPUINFO) as cpuinfo:
            return _fields(cpuinfo)
    except OSError:
        return {}


def _fields(lines: Iterable[str]) -> dict[str, str]:
    fields: dict[str, str] = {}
    for line in lines:
        if not line.strip():
            if fields:
                break
            continue
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return fields


def _flags(fields: dict[str, str]) -> set[str]:
    return set(fields.get("flags", "").split())


def cpu_flags(text: str | None = None) -> set[str]:
    """The CPU's feature flags (of `text`, a /proc/cpuinfo, or this machine's), empty where
    unknown."""
    return _flags(_first_processor(text))


@dataclass
class CpuDescription:
    model_name: str  # /proc/cpuinfo's "model name" ("unknown" where absent)
    family: str  # its "cpu family" ("?" where absent)
    model: str  # its "model" number ("?" where absent)
    num_cpus: int  # CPUs this process may run on (its affinity)
    has: list[str]  # the ISA_FLAGS it has
    lacks: list[str]  # the ISA_FLAGS it lacks (empty where its flags are unknown)

    def line(self) -> str:
        """`Intel(R) Xeon(R) Processor (family 6 model 207), 2 CPUs: avx2 avx512f; no
        avx512_bf16 avx512_fp16 amx_tile amx_bf16`"""
        text = f"{self.model_name} (family {self.family} model {self.model}), {self.num_cpus} CPUs"
        if self.has:
            text += ": " + " ".join(self.has)
        if self.lacks:
            text += "; no " + " ".join(self.lacks)
        return text


def describe_cpu(text: str | None = None, num_cpus: int | None = None) -> CpuDescription:
    """The CPU of `text` (a /proc/cpuinfo; this machine's when None)."""
    fields = _first_processor(text)
    flags = _flags(fields)
    if num_cpus is None:
        num_cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 0
    return CpuDescription(
        model_name=fields.get("model name", "unknown"),
        family=fields.get("cpu family", "?"),
        model=fields.get("model", "?"),
        num_cpus=num_cpus,
        has=[flag for flag in ISA_FLAGS if flag in flags],
        lacks=[flag for flag in ISA_FLAGS if flag not in flags] if flags else [],
    )

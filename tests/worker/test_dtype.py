"""`--dtype auto`: the checkpoint's dtype, on CPU only where the CPU does it natively."""

from __future__ import annotations

import torch

from services.worker import loader
from services.worker.loader import emulated_half, pick_dtype

CPU = torch.device("cpu")


def test_cpu_keeps_bfloat16_only_with_native_support(monkeypatch):
    monkeypatch.setattr(loader, "cpu_flags", lambda: {"avx2", "avx512_bf16"})
    assert pick_dtype("auto", CPU, torch.bfloat16) == torch.bfloat16
    assert pick_dtype("auto", CPU, torch.float16) == torch.float32  # no AMX-FP16
    assert pick_dtype("auto", CPU, torch.float32) == torch.float32
    assert pick_dtype("auto", CPU, None) == torch.float32
    monkeypatch.setattr(loader, "cpu_flags", lambda: {"avx2"})
    assert pick_dtype("auto", CPU, torch.bfloat16) == torch.float32
    assert pick_dtype("bfloat16", CPU, torch.float32) == torch.bfloat16  # asked for: given


def test_gpu_takes_the_checkpoint_half_precision():
    gpu = torch.device("cuda")
    assert pick_dtype("auto", gpu, torch.float16) == torch.float16
    assert pick_dtype("auto", gpu, torch.float32) == torch.bfloat16


class _Matmul:
    def __init__(self, bf16_kind: str) -> None:
        self.bf16_kind = bf16_kind

    def kind(self, dtype: torch.dtype) -> str:
        return self.bf16_kind if dtype == torch.bfloat16 else "avx2"


class _Kernels:
    def __init__(self, bf16_kind: str) -> None:
        self.matmul = _Matmul(bf16_kind)


def test_an_emulated_half_precision_is_named():
    """Warned of at load: bfloat16 on an AVX2-only CPU (oneDNN emulates it), float16 without
    AMX-FP16; not bfloat16 where the CPU has it, nor where textgen's kernel widens it."""
    avx2, widened = _Kernels("onednn"), _Kernels("avx512widen")
    assert emulated_half(torch.bfloat16, {"avx2"}, avx2)  # type: ignore[arg-type]
    assert emulated_half(torch.bfloat16, {"avx2"}, None)
    assert not emulated_half(torch.bfloat16, {"avx2", "avx512f"}, widened)  # type: ignore[arg-type]
    assert not emulated_half(torch.bfloat16, {"avx512_bf16"}, None)
    assert emulated_half(torch.float16, {"avx512_bf16"}, None)
    assert not emulated_half(torch.float16, {"amx_fp16"}, None)
    assert not emulated_half(torch.float32, set(), None)

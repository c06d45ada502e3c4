"""`--dtype auto`: the checkpoint's dtype, on CPU only where the CPU does it natively."""

from __future__ import annotations

import torch

from services.worker import loader
from services.worker.loader import pick_dtype

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

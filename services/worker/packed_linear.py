"""The fast decoder's linear layers (services/worker/fast_decoder.py): weights packed once at
load for whichever matmul runs them fastest here.

A bfloat16 decode step is bound by the stream of its weights: every one is read once per step.
At decode batch sizes oneDNN's packed bfloat16 matmul streams them at ~16 GB/s on two cores
that read 28 GB/s, so on CPUs with AMX textgen runs its own (services/worker/kernels/matmul.py,
~21-25 GB/s). A float32 one is bound by its FMAs on AVX2 and Zen 4 cores, where textgen's own
kernel reaches more of them than oneDNN's (same module). AMX CPUs run float32 on that AVX512
kernel too: with two 512-bit FMA units a core, their batch-32 float32 step is bound by the
weights' stream instead, which the own kernel prefetches ahead of its FMAs and oneDNN's does not
overlap (not yet measured on an AMX CPU). Below AVX2, and for K the AMX kernel does not take,
oneDNN's matmul on its packed layout runs (bfloat16 and float32 matmuls
otherwise re-pack the weight at every call, which costs as much as the product at small batch).

Rounding: bfloat16 outputs equal F.linear's (on AMX up to 32 rows; past that a few in 10^4
differ by rounding, as oneDNN blocks larger products otherwise); float32 ones may differ in the
last bits.
"""

from __future__ import annotations

import torch

from services.worker import kernels
from services.worker.huge_pages import HugePageArena

# rows up to which the AMX kernel beats oneDNN (SmolLM2-135M's four matmuls on 2 cores, bfloat16:
# 9.5 vs 14.5 ms at 32 rows, 75 vs 103 at 512, 245 vs 168 at 2048); longer prompt chunks
# unpack the weight for oneDNN's matmul (~15% of that matmul's time)
AMX_MAX_ROWS = 512
# ... and for products of at most AMX_NARROW_OUT outputs, which oneDNN runs slowly at these row
# counts (a 1024-token prompt's step has a few decode rows more). 2 AMX cores, median of 10, own
# vs oneDNN with the unpack, in ms: 1536 -> 576 at 768, 1024, 1100, 1300, 1536 rows 0.67/1.34,
# 0.88/1.69, 0.92/1.78, 1.15/2.20, 1.32/1.43; 576 -> 960 0.46/0.45, 0.61/0.58, 0.69/1.05,
# 0.80/1.23, 0.95/0.92; 576 -> 576 0.28/0.45, 0.36/0.55, 0.43/0.63, 0.50/0.45, 0.58/0.47; at
# 2048 rows level or oneDNN's; 576 -> 3072 oneDNN's from 768 rows (1.41 vs 1.64)
AMX_NARROW_MAX_ROWS = 1536
AMX_NARROW_OUT = 1024


def supports(dtype: torch.dtype) -> bool:
    """Whether this CPU runs PackedLinear in `dtype` (float32 or bfloat16): oneDNN's bfloat16
    matmul needs AVX512 (BW, VL, DQ) or AVX-NE-CONVERT, which an AVX2-only CPU lacks."""
    if not torch.backends.mkldnn.is_available():
        return False
    return dtype != torch.bfloat16 or bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


class PackedLinear:
    """y = x W^T + b, [num_rows, in_features] -> [num_rows, out_features]."""

    def __init__(
        self,
        weight: torch.Tensor,  # [out_features, in_features]
        bias: torch.Tensor | None = None,  # [out_features]
        ops: kernels.CpuKernels | None = None,  # the CPU kernels, for their matmuls
        gated: bool = False,  # weight is [gate; up] of an MLP (silu_mul may follow it)
        arena: HugePageArena | None = None,  # where the own kernels' packing goes (huge pages)
    ) -> None:
        if not supports(weight.dtype):
            raise ValueError(f"oneDNN cannot run {weight.dtype} matmuls on this CPU")
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        matmul = ops.matmul if ops is not None else None
        # textgen's own kernel where one takes this weight here, else None (oneDNN)
        self.own = matmul if matmul is not None and matmul.takes(weight) else None
        # the float32 and bfloat16 dot-product kernels run silu_mul in the matmul where they
        # take this gate/up: its rows are packed interleaved (MatmulKernels.interleave_gate_up)
        self.fuses_silu = (
            gated and self.own is not None and self.own.takes_gate_up(weight, bias is not None)
        )
        if self.own is not None:
            rows = weight.contiguous()
            if self.fuses_silu:
                rows = self.own.interleave_gate_up(rows)
            packed = self.own.pack(rows)
            self.packed = arena.keep(packed) if arena is not None else packed
        else:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), 32)
        # the most rows the own kernel takes before oneDNN does (AMX_MAX_ROWS, or
        # AMX_NARROW_MAX_ROWS for narrow products); None: every row count (the other own kernels
        # beat oneDNN at all of them: the AVX512-BF16 one, cache-hot on 2 Zen 4 cores, 401 vs
        # 360 GFLOP/s at 2048 rows x 576 -> 3072)
        self._own_max_rows: int | None = None
        if self.kind == "amx":
            narrow = self.out_features <= AMX_NARROW_OUT
            self._own_max_rows = AMX_NARROW_MAX_ROWS if narrow else AMX_MAX_ROWS

    @property
    def kind(self) -> str:
        """The matmul that runs it: amx, avx512bf16, avx512widen, avx512, avx2 or onednn."""
        return "onednn" if self.own is None else self.own.kind(self.packed.dtype)

    def silu_mul(self, x: torch.Tensor, ops: kernels.CpuKernels) -> torch.Tensor:
        """silu(gate) * up of a gated weight's product, in one pass where it fuses them.
        [num_rows, in_features] -> [num_rows, out_features / 2]"""
        if self.fuses_silu:
            assert self.own is not None
            return self.own.linear_silu(x, self.packed, self.out_features // 2)
        return ops.silu_mul(self(x))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.fuses_silu:  # [gate | up] from the interleaved columns (LoRA adds to them)
            assert self.own is not None
            out = self.own.linear(x, self.packed, self.bias, self.out_features)
            return self.own.deinterleave_gate_up(out)
        if self.own is None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [None], "")
        if self._own_max_rows is None or x.shape[0] <= self._own_max_rows:
            return self.own.linear(x, self.packed, self.bias, self.out_features)
        weight = self.own.unpack(self.packed, self.out_features, self.in_features)
        return torch.nn.functional.linear(x, weight, self.bias)


def _concat_bias(*linears: torch.nn.Linear) -> torch.Tensor | None:
    biases = [linear.bias for linear in linears]
    if all(bias is None for bias in biases):
        return None
    return torch.cat(
        [
            bias.detach() if bias is not None else linear.weight.new_zeros(linear.out_features)
            for bias, linear in zip(biases, linears, strict=True)
        ]
    )


def pack(
    ops: kernels.CpuKernels | None,
    *linears: torch.nn.Linear,
    gated: bool = False,
    arena: HugePageArena | None = None,
) -> PackedLinear:
    """One packed matmul for linears that read the same input (`gated`: an MLP's gate and
    up); their weights are released."""
    weight = torch.cat([linear.weight.detach() for linear in linears])
    packed = PackedLinear(weight, _concat_bias(*linears), ops, gated=gated, arena=arena)
    for linear in linears:
        linear.weight = torch.nn.Parameter(linear.weight.new_empty(0), requires_grad=False)
    return packed

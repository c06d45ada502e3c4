"""The fast decoder's linear layers (services/worker/fast_decoder.py): weights packed once at
load for whichever matmul runs them fastest here.

- bfloat16 on a CPU with AMX (and K a multiple of 32): textgen's AMX kernel
  (services/worker/kernels/amx_linear.inc). Decode steps are bound by the weights' stream;
  oneDNN streams them at ~16 GB/s at decode batch sizes, this kernel at ~21-25.
- otherwise oneDNN's matmul on its own packed layout (bfloat16 and float32 matmuls otherwise
  re-pack the weight at every call, which costs as much as the product at small batch).

Outputs equal F.linear's in bfloat16 (on AMX for up to 32 rows; past that a few in 10^4
differ by an ulp, as oneDNN blocks larger products differently); in float32 they may differ in
the last bits.
"""

from __future__ import annotations

import torch

from services.worker import kernels

AMX_K_MULTIPLE = 32  # the AMX kernel's K steps: other widths stay on oneDNN
# rows up to which the AMX kernel beats oneDNN (SmolLM2-135M's four matmuls on 2 cores: 9.5 vs
# 14.5 ms at 32 rows, 75 vs 103 at 512, 245 vs 168 at 2048); longer prompt chunks unpack the
# weight for oneDNN's matmul (~15% of that matmul's time)
AMX_MAX_ROWS = 512


class PackedLinear:
    """y = x W^T + b, [num_rows, in_features] -> [num_rows, out_features]."""

    def __init__(
        self,
        weight: torch.Tensor,  # [out_features, in_features]
        bias: torch.Tensor | None = None,  # [out_features]
        ops: kernels.CpuKernels | None = None,  # the CPU kernels, for the AMX matmul
    ) -> None:
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        self.ops = ops if ops is not None and uses_amx(weight, ops) else None
        self.kind = "amx" if self.ops is not None else "onednn"  # the matmul that runs it
        if self.ops is not None:
            self.packed = self.ops.amx_pack(weight.contiguous())
        else:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), 32)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.ops is not None and x.shape[0] <= AMX_MAX_ROWS:
            return self.ops.amx_linear(x, self.packed, self.bias, self.out_features)
        if self.ops is not None:
            weight = self.ops.amx_unpack(self.packed, self.out_features, self.in_features)
            return torch.nn.functional.linear(x, weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [None], "")


def uses_amx(weight: torch.Tensor, ops: kernels.CpuKernels) -> bool:
    """Whether the AMX kernel takes this weight: bfloat16, K a multiple of 32, AMX here."""
    return ops.has_amx and weight.dtype == torch.bfloat16 and weight.shape[1] % AMX_K_MULTIPLE == 0


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


def pack(ops: kernels.CpuKernels | None, *linears: torch.nn.Linear) -> PackedLinear:
    """One packed matmul for linears that read the same input; their weights are released."""
    weight = torch.cat([linear.weight.detach() for linear in linears])
    packed = PackedLinear(weight, _concat_bias(*linears), ops)
    for linear in linears:
        linear.weight = torch.nn.Parameter(linear.weight.new_empty(0), requires_grad=False)
    return packed

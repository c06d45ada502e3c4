"""The fast decoder's own matmul kernel (amx_linear.inc): bfloat16 on AMX tiles, where the
library was built for them (the amx level) and Linux grants the tile state. It packs a weight
once into its layout and computes x W^T (+ bias). Elsewhere the caller keeps oneDNN
(services/worker/packed_linear.py).

Float32 has none: an AVX512 kernel of the same shape (16 output columns per vector, 16 rows'
sums in registers) ran SmolLM2-135M's matmuls at 52 ms for 32 rows against oneDNN's 40, and
35 vs 20 ms at one row; at 32 rows float32 is bound by the FMAs (170 GFLOP/s on 2 cores), not
by the weights' stream."""

from __future__ import annotations

import ctypes
from typing import Any

import torch
import torch.nn.functional as F

_i64 = ctypes.c_int64
_ptr = ctypes.c_void_p
# x, x_stride, packed, bias, out, out_stride, num_rows, n, k, num_threads
_LINEAR: list[Any] = [_ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64, ctypes.c_int]
K_MULTIPLE = 32  # the AMX kernel's K steps: other widths stay on oneDNN


class MatmulKernels:
    """Typed calls into the library's matmul kernels."""

    def __init__(self, library: ctypes.CDLL) -> None:
        library.amx_ready.restype = ctypes.c_int
        self._amx_linear = library.amx_linear_bf16
        self._amx_linear.argtypes = _LINEAR
        self._amx_linear.restype = None
        self._amx_unpack = library.amx_unpack_bf16
        self._amx_unpack.argtypes = [_ptr, _ptr, _i64, _i64, ctypes.c_int]
        self._amx_unpack.restype = None
        self.has_amx: bool = bool(library.amx_ready())  # built for the tiles, and granted them

    def takes(self, weight: torch.Tensor) -> bool:
        """Whether the AMX kernel takes this weight [n, k] here: bfloat16, k a multiple of 32."""
        return self.has_amx and weight.dtype == torch.bfloat16 and weight.shape[1] % K_MULTIPLE == 0

    @staticmethod
    def pack(weight: torch.Tensor) -> torch.Tensor:
        """`weight` [n, k] in the kernel's layout: panels of 16 output columns (n padded with
        zeros to 32), each [k / 32, 16, 16, 2] (the pairs of inputs a tile's dot products
        read)."""
        n, k = weight.shape
        padded = F.pad(weight, (0, 0, 0, -n % 32))
        return padded.view(-1, 16, k // 32, 16, 2).permute(0, 2, 3, 1, 4).contiguous()

    def unpack(self, packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
        """The weight [n, k] that pack() packed."""
        weight = packed.new_empty(n, k)
        self._amx_unpack(packed.data_ptr(), weight.data_ptr(), n, k, torch.get_num_threads())
        return weight

    def linear(
        self,
        x: torch.Tensor,  # [num_rows, k] bfloat16, rows may be strided
        packed: torch.Tensor,  # pack(weight)
        bias: torch.Tensor | None,  # [n]
        n: int,
    ) -> torch.Tensor:
        """x W^T (+ bias) on AMX tiles. [num_rows, n]"""
        num_rows, k = x.shape
        out = x.new_empty(num_rows, n)
        self._amx_linear(
            x.data_ptr(),
            x.stride(0),
            packed.data_ptr(),
            None if bias is None else bias.data_ptr(),
            out.data_ptr(),
            n,
            num_rows,
            n,
            k,
            torch.get_num_threads(),
        )
        return out

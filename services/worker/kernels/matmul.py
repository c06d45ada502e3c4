"""The fast decoder's own matmul kernels: bfloat16 on AMX tiles (amx_linear.inc), where the library
was built for them (the amx level) and Linux grants the tile state, else on AVX512-BF16 dot products
or on FMAs of weights widened to float32 in registers (bf16_dot_linear.inc) where it was built for
AVX512-BF16 (the avx512 level of a Zen 4, or of a Xeon whose tiles are hidden): the faster of the
two on this core, timed when the library loads (bf16_widen_gain; TEXTGEN_BF16_MATMUL=dot or widen
picks one); on the widened FMAs alone where it was built for AVX512 without AVX512-BF16 (a
Skylake-SP's or an Ice Lake's avx512 level); float32 on AVX2 FMA or AVX512F (f32_linear.inc), where
it was built for AVX2 without AVX512 (the avx2 level) or AVX512 (the avx512 and amx levels). Each
packs a weight once into its layout (the two bfloat16 kernels share one) and computes x W^T (+
bias). Elsewhere (the default level) the caller keeps oneDNN (services/worker/packed_linear.py).

The AVX2 float32 kernel keeps 6 rows x 16 columns of sums in registers; on 2 cores of an AVX2 AMD
EPYC it beats oneDNN at every row count SmolLM2-135M's steps have (its four matmuls x 30 and
lm_head with cold weights, medians of interleaved rounds: 58-70 vs 82-95 ms at 32 rows, ~21 vs ~28
at 1; the four x 30 at 512 rows, prompt chunks: 782 vs 887 ms). The AVX512 one keeps 12 rows x 32
columns (its numbers are in f32_linear.inc). An MLP's gate/up runs on it (and on the bfloat16
AVX512 kernel) as linear_silu: gate and up rows packed interleaved, silu(gate) * up computed on
the sums in registers (SmolLM2-135M in float32 on 2 Zen 4 cores, fused against unfused in turns,
three runs: four 128-token prompts 604 vs 622, 590 vs 615, 552 vs 568 ms; a batch-32 decode step
71.8 vs 75.4 ms in the first run, level in the other two; bfloat16, its 30 gate/up matmuls alone at
512 rows: x0.95)."""

from __future__ import annotations

import ctypes
import logging
import os
from typing import Any

import torch
import torch.nn.functional as F

_i64 = ctypes.c_int64
_ptr = ctypes.c_void_p
# x, x_stride, packed, bias, out, out_stride, num_rows, n, k, num_threads
_LINEAR: list[Any] = [_ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64, ctypes.c_int]
log = logging.getLogger(__name__)
BF16_MATMUL_ENV = "TEXTGEN_BF16_MATMUL"  # dot or widen: that AVX512-BF16 multiply, not the faster
BF16_MULTIPLIES = ("dot", "widen")
K_MULTIPLE = 32  # the AMX kernel's K steps: other widths stay on oneDNN
F32_PANEL = 16  # output columns of one float32 weight panel (f32_linear.inc)


class MatmulKernels:
    """Typed calls into the library's matmul kernels."""

    def __init__(self, library: ctypes.CDLL) -> None:
        for ready in (library.amx_ready, library.bf16_dot_ready, library.f32_linear_ready):
            ready.restype = ctypes.c_int
        self.has_amx: bool = bool(library.amx_ready())  # built for the tiles, and granted them
        built = 0 if self.has_amx else library.bf16_dot_ready()  # the AMX kernel goes first
        # the AVX512 bfloat16 kernel: built for AVX512F and BW without the tiles
        self.has_bf16_avx512: bool = bool(built & 1)
        # ... with its dot products: built for AVX512-BF16 too
        self.has_bf16_dot_products: bool = bool(built & 2)
        # that kernel multiplies widened float32 weights with FMAs, not by dot products
        self.bf16_widens: bool = self.has_bf16_avx512 and (
            not self.has_bf16_dot_products or self._widens(library)
        )
        # built for AVX2 or AVX512: floats per vector (8 or 16; 0: not built)
        self.f32_lanes: int = library.f32_linear_ready()
        self.has_f32: bool = self.f32_lanes > 0
        bf16 = "bf16_widen" if self.bf16_widens else "bf16_dot"
        bf16_linear = (
            library.amx_linear_bf16 if self.has_amx else getattr(library, bf16 + "_linear")
        )
        self._linears = {torch.bfloat16: bf16_linear, torch.float32: library.f32_linear}
        # gate/up with silu_mul: float32's kernel, and bfloat16's AVX512 one
        self._linear_silus = {
            torch.float32: library.f32_linear_silu,
            torch.bfloat16: getattr(library, bf16 + "_linear_silu"),
        }
        for function in (*self._linears.values(), *self._linear_silus.values()):
            function.argtypes = _LINEAR
            function.restype = None
        self._amx_unpack = library.amx_unpack_bf16
        self._amx_unpack.argtypes = [_ptr, _ptr, _i64, _i64, ctypes.c_int]
        self._amx_unpack.restype = None

    @staticmethod
    def _widens(library: ctypes.CDLL) -> bool:
        """Whether the AVX512 bfloat16 kernel, built with dot products, widens: as
        TEXTGEN_BF16_MATMUL asks, else where it runs faster so on this core (an Emerald Rapids
        Xeon: x1.84; a Zen 4, whose dot products issue as fast as its FMAs, should keep
        them)."""
        multiply = os.environ.get(BF16_MATMUL_ENV, "").strip().lower() or None
        if multiply is not None and multiply not in BF16_MULTIPLIES:
            log.warning("%s=%s ignored: it takes dot or widen", BF16_MATMUL_ENV, multiply)
            multiply = None
        if multiply is not None:
            log.info("bfloat16 matmuls: %s (%s)", multiply, BF16_MATMUL_ENV)
            return multiply == "widen"
        library.bf16_widen_gain.restype = ctypes.c_double
        gain = library.bf16_widen_gain()
        choice = "widen" if gain > 1.0 else "dot"
        log.info("bfloat16 matmuls: %s (widened FMAs x%.2f the dot products' speed)", choice, gain)
        return choice == "widen"

    def takes(self, weight: torch.Tensor) -> bool:
        """Whether a kernel here takes this weight [n, k]: bfloat16 with k a multiple of 32 on
        AMX or AVX512, float32 on AVX2 or AVX512."""
        if weight.dtype == torch.float32:
            return self.has_f32
        has_bf16 = self.has_amx or self.has_bf16_avx512
        return has_bf16 and weight.dtype == torch.bfloat16 and weight.shape[1] % K_MULTIPLE == 0

    def kind(self, dtype: torch.dtype) -> str:
        """The kernel that runs a weight of `dtype` it takes: amx, avx512bf16 (dot products),
        avx512widen (FMAs of widened bfloat16 weights), avx512 or avx2; onednn where none
        takes that dtype."""
        if dtype == torch.float32:
            return "onednn" if not self.has_f32 else "avx512" if self.f32_lanes == 16 else "avx2"
        if self.has_amx:
            return "amx"
        if not self.has_bf16_avx512:
            return "onednn"
        return "avx512widen" if self.bf16_widens else "avx512bf16"

    @staticmethod
    def pack(weight: torch.Tensor) -> torch.Tensor:
        """`weight` [n, k] in its kernel's layout. Float32: panels of 16 output columns (n
        padded with zeros to 16), each [k, 16]. Bfloat16: panels of 16 output columns (n padded
        with zeros to 32), each [k / 32, 16, 16, 2] (the pairs of inputs a tile's dot products
        read)."""
        n, k = weight.shape
        if weight.dtype == torch.float32:
            padded = F.pad(weight, (0, 0, 0, -n % F32_PANEL))
            return padded.view(-1, F32_PANEL, k).transpose(1, 2).contiguous()
        padded = F.pad(weight, (0, 0, 0, -n % 32))
        return padded.view(-1, 16, k // 32, 16, 2).permute(0, 2, 3, 1, 4).contiguous()

    def gate_up_lanes(self, dtype: torch.dtype) -> int:
        """Gate (and up) columns of one block of the fused gate/up in `dtype`: a float32
        vector (8 on AVX2, 16 on AVX512), a bfloat16 panel (16); 0 where none fuses them (the
        AMX kernel, oneDNN)."""
        if dtype == torch.float32:
            return self.f32_lanes
        return 16 if dtype == torch.bfloat16 and self.has_bf16_avx512 else 0

    def interleave_gate_up(self, weight: torch.Tensor) -> torch.Tensor:
        """`weight` [2 * width, k], the gate's rows then the up's, with their rows interleaved
        gate_up_lanes at a time (gate 0-7, up 0-7, gate 8-15, ... on AVX2): the layout whose
        packing linear_silu takes, each block's sums then holding a gate and its up."""
        lanes = self.gate_up_lanes(weight.dtype)
        gate, up = weight.view(2, -1, lanes, weight.shape[1]).unbind(0)
        return torch.stack([gate, up], dim=1).reshape(weight.shape)

    def deinterleave_gate_up(self, out: torch.Tensor) -> torch.Tensor:
        """The product [num_rows, 2 * width] of an interleave_gate_up weight as [gate | up]."""
        halves = out.view(out.shape[0], -1, 2, self.gate_up_lanes(out.dtype)).transpose(1, 2)
        return halves.reshape(out.shape)

    def takes_gate_up(self, weight: torch.Tensor, has_bias: bool) -> bool:
        """Whether linear_silu takes this gate/up weight [2 * width, k]: on the float32 kernel
        or the bfloat16 dot-product one, no bias, width a multiple of gate_up_lanes."""
        lanes = self.gate_up_lanes(weight.dtype)
        width, odd = divmod(weight.shape[0], 2)
        return self.takes(weight) and lanes > 0 and not has_bias and not odd and width % lanes == 0

    def linear_silu(self, x: torch.Tensor, packed: torch.Tensor, width: int) -> torch.Tensor:
        """silu(gate) * up of x's gate/up product, with `packed` = pack(interleave_gate_up(W)).
        [num_rows, k] -> [num_rows, width]"""
        return self._run(self._linear_silus[x.dtype], x, packed, None, 2 * width, width)

    def unpack(self, packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
        """The bfloat16 weight [n, k] that pack() packed."""
        weight = packed.new_empty(n, k)
        self._amx_unpack(packed.data_ptr(), weight.data_ptr(), n, k, torch.get_num_threads())
        return weight

    def linear(
        self,
        x: torch.Tensor,  # [num_rows, k] of the weight's dtype, rows may be strided
        packed: torch.Tensor,  # pack(weight)
        bias: torch.Tensor | None,  # [n]
        n: int,
    ) -> torch.Tensor:
        """x W^T (+ bias) on the kernel for x's dtype. [num_rows, n]"""
        return self._run(self._linears[x.dtype], x, packed, bias, n, n)

    @staticmethod
    def _run(
        function: Any,
        x: torch.Tensor,
        packed: torch.Tensor,
        bias: torch.Tensor | None,
        n: int,  # the packed weight's output columns
        width: int,  # out's columns: n, or n / 2 where silu(gate) * up is computed
    ) -> torch.Tensor:
        """One call of a matmul kernel of the _LINEAR signature."""
        if x.stride(1) != 1:  # the kernels step through a row's inputs one element apart
            x = x.contiguous()
        num_rows, k = x.shape
        out = x.new_empty(num_rows, width)
        function(
            x.data_ptr(),
            x.stride(0),
            packed.data_ptr(),
            None if bias is None else bias.data_ptr(),
            out.data_ptr(),
            width,
            num_rows,
            n,
            k,
            torch.get_num_threads(),
        )
        return out

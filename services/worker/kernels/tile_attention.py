"""Causal attention of bfloat16 prompt chunks on AMX tiles (amx_attention.inc): where the library
was built for the tiles and Linux grants them (MatmulKernels.has_amx), dense prompt chunks
(services/worker/dense_prefill.py) attend here instead of in torch's fused attention.

Queries, keys and values are read in place through their strides (a step's qkv rows, or the
keys gathered from the paged cache), so a chunk costs no copies but the kernel's own repacking
of its keys and values (2 x num_kv_heads x keys x head_dim bfloat16 of scratch)."""

from __future__ import annotations

import ctypes
from typing import Any

import torch

_i64 = ctypes.c_int64
_ptr = ctypes.c_void_p
# q, q_row, k, k_row, k_head, v, v_row, v_head, out, out_row, num_queries, num_keys, num_heads,
# num_kv_heads, head_dim, scale, scratch, num_threads
_ATTEND: list[Any] = [_ptr, _i64, _ptr, _i64, _i64, _ptr, _i64, _i64, _ptr, _i64]
_ATTEND += [_i64, _i64, _i64, _i64, _i64, ctypes.c_float, _ptr, ctypes.c_int]
KEY_STEP = 32  # keys the kernel scores at once: its scratch holds keys rounded up to it
DIM_MULTIPLE = 32  # head dimensions it takes: multiples of this ...
MAX_HEAD_DIM = 256  # ... up to this (cpu_kernels.c)


class TileAttention:
    """Typed calls into amx_attention_bf16."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._attend = library.amx_attention_bf16
        self._attend.argtypes = _ATTEND
        self._attend.restype = None

    @staticmethod
    def takes(dtype: torch.dtype, head_dim: int) -> bool:
        """Whether the kernel computes heads of this type and size."""
        return dtype == torch.bfloat16 and head_dim % DIM_MULTIPLE == 0 and head_dim <= MAX_HEAD_DIM

    def attend(
        self,
        q: torch.Tensor,  # [num_queries, num_heads, head_dim] (rows strided, heads packed)
        k: torch.Tensor,  # [num_keys, num_kv_heads, head_dim] (rows and heads strided)
        v: torch.Tensor,  # [num_keys, num_kv_heads, head_dim] (rows and heads strided)
        out: torch.Tensor,  # [num_queries, num_heads, head_dim] (rows strided, heads packed)
        scale: float,
    ) -> None:
        """out = softmax(q k^T scale) v per head, query r seeing keys 0 .. r + num_keys -
        num_queries (the chunk's queries are its request's last tokens)."""
        num_queries, num_heads, head_dim = q.shape
        num_keys, num_kv_heads, _ = k.shape
        for tensor in (q, k, v, out):
            assert tensor.dtype == torch.bfloat16 and tensor.stride(2) == 1, "strided dims"
        for tensor in (q, out):
            assert tensor.stride(1) == head_dim, "the heads of a row must be packed"
        assert num_queries <= num_keys and num_heads % num_kv_heads == 0
        padded = -(-num_keys // KEY_STEP) * KEY_STEP
        scratch = torch.empty(2 * num_kv_heads * padded * head_dim, dtype=torch.bfloat16)
        self._attend(
            q.data_ptr(),
            q.stride(0),
            k.data_ptr(),
            k.stride(0),
            k.stride(1),
            v.data_ptr(),
            v.stride(0),
            v.stride(1),
            out.data_ptr(),
            out.stride(0),
            num_queries,
            num_keys,
            num_heads,
            num_kv_heads,
            head_dim,
            scale,
            scratch.data_ptr(),
            torch.get_num_threads(),
        )

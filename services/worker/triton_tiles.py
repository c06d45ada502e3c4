"""Paged attention for prompt chunks on the GPU: a Triton kernel over tiles of consecutive
queries of one request (services/worker/triton_attention.py has the one for query rows).

A tile is up to BLOCK_M consecutive queries of one request's chunk, query j of a chunk of q_len
over context_len cached keys seeing keys 0..context_len - q_len + j (causal):

    tile t: tokens start[t]..start[t] + rows[t] - 1 of the packed step, request request[t],
    its first query seeing lens[t] keys, the next lens[t] + 1, ...

Program (t, h) keeps query head h of tile t; it walks the keys the tile's last query sees in
tiles of BLOCK_N, read once for all its queries through the request's block table, with two
tl.dot per key tile (scores, then weights times values) and an online softmax in float32; a
query masks the keys past its own position (and before its sliding window). Float32 dots are
IEEE (no TF32), so float32 output stays equal to PyTorch's attention up to rounding.

Without a GPU it runs in Triton's interpreter, which is how CI checks it in float32 (the
interpreter's bfloat16 dots are wrong: numpy has no bfloat16, so a half-precision check on a
CPU falls back to SDPA); services/worker/kernel_checks.py checks it on the worker's own
device before the first chunk it would take.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.worker.triton_attention import BLOCK_N, PER_STEP, strides


@triton.jit(do_not_specialize=PER_STEP)
def _paged_tiles_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim]
    q_ptr,  # [num_tokens, num_heads, head_dim] (any strides)
    k_ptr,  # [num_slots, num_kv_heads, head_dim]
    v_ptr,
    tile_start_ptr,  # [num_tiles] int32 packed token of the tile's first query
    tile_rows_ptr,  # [num_tiles] int32 queries in the tile (at most BLOCK_M)
    tile_request_ptr,  # [num_tiles] int32 block table row of the tile's request
    tile_lens_ptr,  # [num_tiles] int32 keys the tile's first query sees (causal)
    tables_ptr,  # [num_requests, max_blocks] int32
    scale,
    window,  # 0: no sliding window
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    stride_table,
    group: tl.constexpr,  # query heads per key/value head
    head_dim: tl.constexpr,
    dims_pow2: tl.constexpr,  # head_dim rounded up to a power of two of at least 16 (tl.dot)
    block_size: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,  # tl.dot's input precision: "ieee" for float32 (no TF32)
):
    tile = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // group
    first_token = tl.load(tile_start_ptr + tile)
    num_rows = tl.load(tile_rows_ptr + tile)
    request = tl.load(tile_request_ptr + tile)
    first_len = tl.load(tile_lens_ptr + tile)
    queries = tl.arange(0, BLOCK_M)
    row_ok = queries < num_rows
    lens = first_len + queries  # keys each query sees
    last = first_len + num_rows - 1  # keys the tile's last query sees
    first = last * 0
    if window > 0:
        first = tl.maximum(first_len - window, 0)
    start = first // BLOCK_N * BLOCK_N
    dims = tl.arange(0, dims_pow2)
    dim_ok = dims < head_dim
    tokens = (first_token + queries).to(tl.int64)
    q = tl.load(
        q_ptr + tokens[:, None] * stride_qt + head * stride_qh + dims[None, :],
        mask=row_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )  # [BLOCK_M, dims]
    running_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    running_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, dims_pow2], tl.float32)
    table = tables_ptr + request * stride_table
    while start < last:
        keys = start + tl.arange(0, BLOCK_N)
        key_ok = (keys < last) & (keys >= first)
        block = tl.load(table + keys // block_size, mask=key_ok, other=0)
        slots = block.to(tl.int64) * block_size + keys % block_size
        kv_mask = key_ok[:, None] & dim_ok[None, :]
        k = tl.load(
            k_ptr + slots[:, None] * stride_ks + kv_head * stride_kh + dims[None, :],
            mask=kv_mask,
            other=0.0,
        )  # [BLOCK_N, dims]
        scores = tl.dot(q, tl.trans(k).to(q.dtype), input_precision=PRECISION) * scale
        visible = (keys[None, :] < lens[:, None]) & key_ok[None, :]
        if window > 0:
            visible = visible & (keys[None, :] >= lens[:, None] - window)
        scores = tl.where(visible, scores, float("-inf"))  # [BLOCK_M, BLOCK_N]
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        # a query that sees none of these keys yet keeps a max of -inf: subtract 0 instead
        shift = tl.where(new_max > float("-inf"), new_max, 0.0)
        correction = tl.exp(running_max - shift)
        weights = tl.exp(scores - shift[:, None])
        v = tl.load(
            v_ptr + slots[:, None] * stride_vs + kv_head * stride_vh + dims[None, :],
            mask=kv_mask,
            other=0.0,
        )
        running_sum = running_sum * correction + tl.sum(weights, axis=1)
        acc = acc * correction[:, None] + tl.dot(
            weights.to(q.dtype), v.to(q.dtype), input_precision=PRECISION
        )
        running_max = new_max
        start += BLOCK_N
    out = acc / tl.where(running_sum > 0, running_sum, 1.0)[:, None]
    tl.store(
        out_ptr + tokens[:, None] * stride_ot + head * stride_oh + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & dim_ok[None, :],
    )


def attend_tiles(
    out: torch.Tensor,  # [num_tokens, num_heads, head_dim], written at the tiles' tokens
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim] (any strides, last dim dense)
    k_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    tile_start: torch.Tensor,  # [num_tiles] int32
    tile_rows: torch.Tensor,  # [num_tiles] int32
    tile_request: torch.Tensor,  # [num_tiles] int32
    tile_lens: torch.Tensor,  # [num_tiles] int32
    block_tables: torch.Tensor,  # [num_requests, max_blocks] int32
    block_size: int,
    scaling: float | None,
    sliding_window: int | None,
    block_m: int,
) -> None:
    """Every tile's queries (consecutive ones of one request) over their request's cached keys,
    causally, into `out`: a tile's keys and values are read once for all its queries."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    assert query.stride(2) == out.stride(2) == k_cache.stride(2) == v_cache.stride(2) == 1
    _paged_tiles_kernel[(tile_start.shape[0], num_heads)](
        out,
        query,
        k_cache,
        v_cache,
        tile_start,
        tile_rows,
        tile_request,
        tile_lens,
        block_tables,
        head_dim**-0.5 if scaling is None else scaling,
        sliding_window or 0,
        *strides(out, query, k_cache, v_cache),
        block_tables.stride(0),
        group=num_heads // k_cache.shape[1],
        head_dim=head_dim,
        dims_pow2=max(16, triton.next_power_of_2(head_dim)),
        block_size=block_size,
        BLOCK_M=block_m,
        BLOCK_N=BLOCK_N,
        PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
    )

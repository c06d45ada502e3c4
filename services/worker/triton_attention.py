"""Paged attention for query rows on the GPU: one Triton kernel, nothing beyond PyTorch's image.

Each query row reads its own request's keys and values straight from the paged KV cache
through the request's block table, so nothing is gathered or copied first, and the launch
depends only on tensor shapes (a CUDA graph can hold it: services/worker/cuda_graphs.py):

    row r: token rows[r] of the packed step, request row_request[r], sees keys 0..row_lens[r]-1
    key t of request i: slot block_tables[i][t // block_size] * block_size + t % block_size

A decode is one row with row_lens = its context length; a short chunk (speculative drafts)
is a row per query, query j of q_len seeing context_len - q_len + j + 1 keys (causal, the
SDPA path's rule). Program (r, h) keeps query head h of row r and walks the keys in tiles of
BLOCK_N with an online softmax in float32 (scores, running max and sum, accumulator), the
rounding of PyTorch's fused attention kernels. Grouped-query heads share their key/value head
(h // group); a sliding window of W keys starts at row_lens - W.

Few rows (a decode of one or two requests) would leave most of the GPU idle while each
program walks its keys tile after tile, so their keys are split in `splits` (chosen from the
row and head counts, which a CUDA graph fixes) contiguous ranges, a program (r, h, s) each; each
writes its running max, sum and accumulator to scratch, and a second kernel merges a row's
ranges (flash-decoding's split-KV).

Without a GPU the kernel runs in Triton's interpreter (TRITON_INTERPRET=1, set before this
module is imported), which is how CI checks it against PyTorch's attention.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

TRITON = "triton"  # the attention name the worker reports (/info model_attention)
BLOCK_N = 64  # keys per tile
# Arguments that change from step to step: Triton compiles a kernel again for each new value
# class of a specialized integer (1, a multiple of 16, other), which stalled a served run for
# ~0.7 s whenever the widest block table crossed one (8 -> 16 -> 17 blocks); not specialized,
# one build serves every step
PER_STEP = ["stride_table"]
TARGET_PROGRAMS = 256  # rows x heads x splits aimed at: ~2 programs per SM of a large GPU
MAX_SPLITS = 16


@triton.jit(do_not_specialize=PER_STEP)
def _paged_rows_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim]
    q_ptr,  # [num_tokens, num_heads, head_dim] (any strides)
    k_ptr,  # [num_slots, num_kv_heads, head_dim]
    v_ptr,
    rows_ptr,  # [num_rows] int32 packed token of each row
    row_request_ptr,  # [num_rows] int32 block table row of each row
    row_lens_ptr,  # [num_rows] int32 keys each row sees
    tables_ptr,  # [num_requests, max_blocks] int32
    part_acc_ptr,  # SPLITS > 1: [num_rows, num_heads, SPLITS, head_dim_pow2] float32
    part_stats_ptr,  # SPLITS > 1: [num_rows, num_heads, SPLITS, 2] float32 (max, sum)
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
    head_dim_pow2: tl.constexpr,
    block_size: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLITS: tl.constexpr,  # key ranges per row (1: the program writes the output itself)
):
    row = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // group
    token = tl.load(rows_ptr + row)
    request = tl.load(row_request_ptr + row)
    length = tl.load(row_lens_ptr + row)
    first = length * 0
    if window > 0:
        first = tl.maximum(length - window, 0)
    start = first // BLOCK_N * BLOCK_N
    end = length
    if SPLITS > 1:  # this program's range: whole tiles, the last range cut at `length`
        tiles = ((length - start + BLOCK_N - 1) // BLOCK_N + SPLITS - 1) // SPLITS
        start += tl.program_id(2) * tiles * BLOCK_N
        end = tl.minimum(length, start + tiles * BLOCK_N)
    dims = tl.arange(0, head_dim_pow2)
    dim_ok = dims < head_dim
    q = tl.load(q_ptr + token * stride_qt + head * stride_qh + dims, mask=dim_ok, other=0.0)
    q = q.to(tl.float32) * scale
    running_max = tl.full([1], float("-inf"), tl.float32)
    running_sum = tl.zeros([1], tl.float32)
    acc = tl.zeros([head_dim_pow2], tl.float32)
    table = tables_ptr + request * stride_table
    while start < end:  # (a while loop: Triton's interpreter cannot range() over loads)
        keys = start + tl.arange(0, BLOCK_N)
        valid = (keys < length) & (keys >= first)
        block = tl.load(table + keys // block_size, mask=valid, other=0)
        slots = block.to(tl.int64) * block_size + keys % block_size
        kv_mask = valid[:, None] & dim_ok[None, :]
        k = tl.load(
            k_ptr + slots[:, None] * stride_ks + kv_head * stride_kh + dims[None, :],
            mask=kv_mask,
            other=0.0,
        )
        scores = tl.sum(k.to(tl.float32) * q[None, :], axis=1)  # [BLOCK_N]
        scores = tl.where(valid, scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, axis=0))
        correction = tl.exp(running_max - new_max)
        weights = tl.exp(scores - new_max)  # [BLOCK_N]
        v = tl.load(
            v_ptr + slots[:, None] * stride_vs + kv_head * stride_vh + dims[None, :],
            mask=kv_mask,
            other=0.0,
        )
        running_sum = running_sum * correction + tl.sum(weights, axis=0)
        acc = acc * correction + tl.sum(weights[:, None] * v.to(tl.float32), axis=0)
        running_max = new_max
        start += BLOCK_N
    if SPLITS > 1:
        part = (row * tl.num_programs(1) + head) * SPLITS + tl.program_id(2)
        tl.store(part_acc_ptr + part * head_dim_pow2 + dims, acc)
        tl.store(part_stats_ptr + part * 2 + tl.arange(0, 1), running_max)
        tl.store(part_stats_ptr + part * 2 + 1 + tl.arange(0, 1), running_sum)
    else:
        out = acc / tl.where(running_sum > 0, running_sum, 1.0)
        tl.store(
            out_ptr + token * stride_ot + head * stride_oh + dims,
            out.to(out_ptr.dtype.element_ty),
            mask=dim_ok,
        )


@triton.jit
def _merge_splits_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim]
    rows_ptr,  # [num_rows] int32 packed token of each row
    part_acc_ptr,  # [num_rows, num_heads, SPLITS, head_dim_pow2] float32
    part_stats_ptr,  # [num_rows, num_heads, SPLITS, 2] float32 (max, sum)
    stride_ot,
    stride_oh,
    head_dim: tl.constexpr,
    head_dim_pow2: tl.constexpr,
    SPLITS: tl.constexpr,
):
    """Program (r, h): row r's key ranges of head h, weighed by exp(range max - overall max)."""
    row = tl.program_id(0)
    head = tl.program_id(1)
    token = tl.load(rows_ptr + row)
    parts = (row * tl.num_programs(1) + head) * SPLITS + tl.arange(0, SPLITS)
    maxes = tl.load(part_stats_ptr + parts * 2)
    sums = tl.load(part_stats_ptr + parts * 2 + 1)
    top = tl.max(maxes, axis=0)
    weights = tl.where(maxes > float("-inf"), tl.exp(maxes - top), 0.0)  # empty ranges: 0
    dims = tl.arange(0, head_dim_pow2)
    accs = tl.load(part_acc_ptr + parts[:, None] * head_dim_pow2 + dims[None, :])
    total = tl.sum(weights * sums, axis=0)
    out = tl.sum(weights[:, None] * accs, axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(
        out_ptr + token * stride_ot + head * stride_oh + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=dims < head_dim,
    )


def strides(out, query, k_cache, v_cache) -> tuple[int, ...]:
    """What the rows and tile kernels take after scale and window: the query's and the
    output's strides by token and head, then each cache's by slot and head."""
    return (
        *query.stride()[:2],
        *out.stride()[:2],
        *k_cache.stride()[:2],
        *v_cache.stride()[:2],
    )


def num_splits(num_rows: int, num_heads: int) -> int:
    """Key ranges per row: the largest power of two up to MAX_SPLITS that keeps the programs
    within TARGET_PROGRAMS (1 once the rows alone fill the GPU)."""
    splits = 1
    while splits < MAX_SPLITS and num_rows * num_heads * splits * 2 <= TARGET_PROGRAMS:
        splits *= 2
    return splits


def attend_rows(
    out: torch.Tensor,  # [num_tokens, num_heads, head_dim], written at the rows' tokens
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim] (any strides, last dim dense)
    k_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    rows: torch.Tensor,  # [num_rows] int32
    row_request: torch.Tensor,  # [num_rows] int32
    row_lens: torch.Tensor,  # [num_rows] int32
    block_tables: torch.Tensor,  # [num_requests, max_blocks] int32
    block_size: int,
    scaling: float | None,
    sliding_window: int | None,
    splits: int | None = None,  # key ranges per row (a power of two; None: num_splits)
) -> None:
    """Every row's query heads over its request's first row_lens cached keys, into `out`."""
    num_rows = rows.shape[0]
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = k_cache.shape[1]
    assert query.stride(2) == out.stride(2) == k_cache.stride(2) == v_cache.stride(2) == 1
    if splits is None:  # interpreted on a CPU, programs run one after another: no split
        splits = num_splits(num_rows, num_heads) if query.is_cuda else 1
    head_dim_pow2 = triton.next_power_of_2(head_dim)
    part_acc = part_stats = out  # unused unless split
    if splits > 1:
        parts = num_rows * num_heads * splits
        part_acc = torch.empty(parts, head_dim_pow2, dtype=torch.float32, device=out.device)
        part_stats = torch.empty(parts, 2, dtype=torch.float32, device=out.device)
    _paged_rows_kernel[(num_rows, num_heads, splits)](
        out,
        query,
        k_cache,
        v_cache,
        rows,
        row_request,
        row_lens,
        block_tables,
        part_acc,
        part_stats,
        head_dim**-0.5 if scaling is None else scaling,
        sliding_window or 0,
        *strides(out, query, k_cache, v_cache),
        block_tables.stride(0),
        group=num_heads // num_kv_heads,
        head_dim=head_dim,
        head_dim_pow2=head_dim_pow2,
        block_size=block_size,
        BLOCK_N=BLOCK_N,
        SPLITS=splits,
    )
    if splits > 1:
        _merge_splits_kernel[(num_rows, num_heads)](
            out,
            rows,
            part_acc,
            part_stats,
            out.stride(0),
            out.stride(1),
            head_dim=head_dim,
            head_dim_pow2=head_dim_pow2,
            SPLITS=splits,
        )

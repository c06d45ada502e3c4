"""GPU attention over the paged KV cache with flash-attn 2 (`flash_attn_varlen_func`, paged).

On CUDA, with flash-attn installed and a half-precision cache, the runner builds one
`FlashMetadata` per step (`make_metadata`, from the same query_start / context_lens / block
tables as the SDPA path) and `paged_attention_forward` hands every layer's attention to
`attend` once the step's keys/values are in the cache. The cache needs no copy: a layer's
[num_slots, kv_heads, head_dim] tensor viewed as [num_blocks, block_size, kv_heads, head_dim]
is exactly flash-attn's paged layout, and a request's block table row lists its pages:

    request r1, context_len 300, block_size 256:   block_table[1] = [7, 2, 0, ...]
    keys 0..255 -> block 7 (slots 7*256 ..), keys 256..299 -> block 2; 0s pad the row

flash-attn aligns the causal mask to the bottom right (since 2.1): query j of a request with
q_len queries and context_len keys sees keys 0..context_len - q_len + j, as the SDPA path does.
Its paged KV needs pages of a multiple of 256 tokens (`flash_block_size`).
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from services.worker.kv_cache import CacheShape, PagedKVCache

log = logging.getLogger(__name__)

FLASH_ATTN = "flash-attn"  # attention kernel names, as the worker reports them
SDPA = "sdpa"
FLASH_BLOCK_SIZE = 256  # flash-attn 2 pages a KV cache only in multiples of this many tokens
MAX_HEAD_DIM = 256  # flash-attn 2's largest head dimension


@dataclass
class FlashMetadata:
    """One step's arguments to flash_attn_varlen_func, on the device, shared by all layers."""

    cu_seqlens_q: torch.Tensor  # [num_requests + 1] int32: query_start
    cu_seqlens_k: torch.Tensor  # [num_requests + 1] int32: running sum of context_lens
    max_seqlen_q: int  # most queries of one request this step
    max_seqlen_k: int  # longest context (cached tokens after this step's write)
    block_table: torch.Tensor  # [num_requests, max_blocks] int32 page ids, padded with 0
    block_size: int  # tokens per page (a multiple of FLASH_BLOCK_SIZE)


@functools.cache
def _varlen_func() -> Callable | None:
    """flash_attn_varlen_func if flash-attn is installed and takes a block table, else None."""
    try:
        from flash_attn import flash_attn_varlen_func
    except Exception:  # not installed, or a build that does not match this torch/CUDA
        return None
    try:
        parameters = inspect.signature(flash_attn_varlen_func).parameters
    except (TypeError, ValueError):
        return None
    return flash_attn_varlen_func if "block_table" in parameters else None


def is_available(device: torch.device | str, shape: CacheShape | None = None) -> bool:
    """flash-attn can attend on this device (and over a cache of this shape, if given)."""
    if torch.device(device).type != "cuda":
        return False
    if shape is not None and (
        shape.dtype not in (torch.float16, torch.bfloat16)
        or shape.head_dim % 8
        or shape.head_dim > MAX_HEAD_DIM
    ):
        return False
    return _varlen_func() is not None


def flash_block_size(requested: int, device: torch.device | str, shape: CacheShape) -> int:
    """The KV block size to allocate: where flash-attn can read this cache, `requested`
    rounded up to a multiple of FLASH_BLOCK_SIZE (16 becomes 256); otherwise `requested`."""
    if requested % FLASH_BLOCK_SIZE == 0 or not is_available(device, shape):
        return requested
    block_size = -(-requested // FLASH_BLOCK_SIZE) * FLASH_BLOCK_SIZE
    log.info(
        "KV block size %d instead of %d: flash-attn's paged KV cache needs multiples of %d",
        block_size,
        requested,
        FLASH_BLOCK_SIZE,
    )
    return block_size


def make_metadata(
    query_start: list[int],  # [num_requests + 1]
    context_lens: list[int],  # [num_requests]
    block_tables: list[list[int]],  # per request: its block ids (may reserve blocks ahead)
    block_size: int,
    device: torch.device,
) -> FlashMetadata:
    """The step's FlashMetadata; each block table is cut to the blocks its context fills and
    padded with 0 to the longest, and everything goes to the device in one copy."""
    num_requests = len(context_lens)
    table, max_blocks = PagedKVCache.padded_block_tables(block_tables, context_lens, block_size)
    cu_seqlens_k = [0]
    for length in context_lens:
        cu_seqlens_k.append(cu_seqlens_k[-1] + length)
    packed = torch.tensor(query_start + cu_seqlens_k + table, dtype=torch.int32).to(device)
    q_lens = [end - start for start, end in zip(query_start, query_start[1:])]
    return FlashMetadata(
        cu_seqlens_q=packed[: num_requests + 1],
        cu_seqlens_k=packed[num_requests + 1 : 2 * num_requests + 2],
        max_seqlen_q=max(q_lens),
        max_seqlen_k=max(context_lens),
        block_table=packed[2 * num_requests + 2 :].view(num_requests, max_blocks),
        block_size=block_size,
    )


def attend(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim], this step's keys written
    v_cache: torch.Tensor,
    meta: FlashMetadata,
    scaling: float | None,
    sliding_window: int | None,
) -> torch.Tensor:
    """Every request's queries over its cached keys/values. [num_tokens, num_heads, head_dim]"""
    num_slots, kv_heads, head_dim = k_cache.shape
    pages = (num_slots // meta.block_size, meta.block_size, kv_heads, head_dim)
    varlen = _varlen_func()
    assert varlen is not None, "FlashMetadata was built without flash-attn"
    out = varlen(
        query.to(k_cache.dtype),
        k_cache.view(pages),
        v_cache.view(pages),
        meta.cu_seqlens_q,
        meta.cu_seqlens_k,
        meta.max_seqlen_q,
        meta.max_seqlen_k,
        softmax_scale=scaling,
        causal=True,
        # a window of W keys: the query's own and the W - 1 before it (as _causal_mask)
        window_size=(sliding_window - 1, 0) if sliding_window else (-1, -1),
        block_table=meta.block_table,
    )
    return out.to(query.dtype)

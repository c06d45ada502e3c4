"""Prompt chunks of 64 tokens or more attend with torch's fused attention.

The paged attention kernel (services/worker/kernels) walks a request's cached blocks query by
query: right for decodes and short chunks, slow for a long prompt, whose cost grows with the
square of its length (a 1024-token prompt of SmolLM2-135M spent ~500 of its 727 ms there, on
2 cores in bfloat16, against 229 ms of matmuls). `scaled_dot_product_attention` on 4-D inputs
computes it as blocked matmuls (flash attention for CPUs):

- a chunk that is its request's whole context reads its rotated keys and values straight from
  this step's qkv rows, with a causal mask;
- a chunk after cached tokens (the next chunk of a long prompt, a prefix-cache hit) reads
  every key and value of its request from the paged cache (the step's were written by
  rope_store), in the fast decoder's block layout (cpu_kernels.c), with the causal mask
  shifted by the cached length.

Decodes and short chunks go to the kernel with tables of their own, and every chunk does
where torch's fused attention cannot run the model's dtype (`is_supported`), or where the
kernel is the faster one (`min_keys`). Per 512 prompt tokens of SmolLM2-135M on a 2-core AMD
EPYC (Zen 4), prompts of 128 to 2048 tokens in chunks of 512 (SDPA vs the kernel):

    kernels built for   dtype      128 tokens   512 tokens   1024 tokens   2048 tokens
    avx512              bfloat16   371 / 349    523 / 426    586 / 549     759 / 731 ms
    avx512              float32    630 / 593    757 / 748    884 / 802     1019 / 929 ms
    avx2                float32    646 / 652    752 / 732    801 / 912     1041 / 1207 ms

so with AVX512 the kernel attends every chunk, with AVX2 chunks over 1024 keys or more go to
torch, and on AMX (where torch's attention runs bfloat16 on the tiles; the measurement that
brought this module in, on a Xeon) every chunk of DENSE_MIN_QUERIES does. On AMX bfloat16 chunks
attend on the tiles (kernels/tile_attention.py: twice torch's speed at 1024 tokens), from
TILE_MIN_QUERIES queries.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from services.worker.kernels.tile_attention import TileAttention

DENSE_MIN_QUERIES = 64  # shorter chunks are cheap for the kernel
# ... and where the AMX kernel takes them (kernels/tile_attention.py), which beats it from 32
# queries (2 AMX cores, SmolLM2-135M's heads, per layer, kernel against tiles after a prefix of
# 128, 512, 2048 keys: 16 queries 0.09/0.11, 0.16/0.20, 0.56/1.60 ms; 32 0.15/0.12, 0.24/0.23,
# 0.85/0.66; 48 0.23/0.14, 0.38/0.24, 1.39/0.76)
TILE_MIN_QUERIES = 32
# by the instruction set the kernels were built for (services/worker/kernels): the fewest keys
# a chunk attends for torch's fused attention to take it; None: the kernel takes every chunk
DENSE_MIN_KEYS: dict[str, int | None] = {"amx": 0, "avx512": None}
OTHER_MIN_KEYS = 1024  # avx2, default, native


def min_keys(level: str, dtype: torch.dtype) -> int | None:
    """The fewest keys of a chunk that attends densely, for kernels built for `level`; None:
    none does (the kernel is faster there, or torch's attention cannot run `dtype`)."""
    if not is_supported(dtype):
        return None
    return DENSE_MIN_KEYS.get(level, OTHER_MIN_KEYS)


def is_supported(dtype: torch.dtype) -> bool:
    """Whether torch's fused CPU attention runs `dtype` here: float32 everywhere; bfloat16
    only down torch's AVX512 path (on its AVX2 path, ATEN_CPU_CAPABILITY=avx2 included,
    torch 2.13 raises "pack_vnni2 is only supported when avx512 is supported")."""
    return dtype == torch.float32 or torch.backends.cpu.get_cpu_capability() == "AVX512"


@dataclass
class AttentionSplit:
    """Which requests of a step attend densely, and the tables of the others."""

    dense: list[tuple[int, int, int, int]]  # (first row, end row, keys, request) per dense chunk
    paged_rows: torch.Tensor | None  # [n] int64 rows the kernel attends; None: every row
    query_start: torch.Tensor  # the kernel's tables over paged_rows (the step's when all)
    context_lens: torch.Tensor
    block_tables: torch.Tensor
    all_block_tables: torch.Tensor | None = None  # the step's, for dense chunks after a prefix

    @property
    def longest_dense(self) -> int:
        """The most keys a dense chunk attends."""
        return max((keys for _, _, keys, _ in self.dense), default=0)

    @classmethod
    def of(
        cls,
        query_start: list[int],
        context_lens: list[int],
        block_tables: torch.Tensor,  # [num_requests, max_blocks] int64
        starts: torch.Tensor,  # query_start as a tensor (the step's, built once)
        lens: torch.Tensor,  # context_lens as a tensor
        min_keys: int | None = 0,  # `min_keys`: None, none attends densely
        min_queries: int = DENSE_MIN_QUERIES,  # the fewest queries of a dense chunk
    ) -> AttentionSplit:
        dense, paged = [], []
        for index, context_len in enumerate(context_lens):
            start, end = query_start[index], query_start[index + 1]
            is_dense = min_keys is not None and context_len >= min_keys
            if is_dense and end - start >= min_queries:
                dense.append((start, end, context_len, index))
            else:
                paged.append(index)
        if not dense:
            return cls([], None, starts, lens, block_tables)
        rows: list[int] = []
        offsets = [0]
        for index in paged:
            rows.extend(range(query_start[index], query_start[index + 1]))
            offsets.append(len(rows))
        chosen = torch.tensor(paged, dtype=torch.int64)
        return cls(
            dense,
            torch.tensor(rows, dtype=torch.int64),
            torch.tensor(offsets, dtype=torch.int64),
            lens.index_select(0, chosen),
            block_tables.index_select(0, chosen),
            block_tables,
        )


def attend_dense(
    qkv: torch.Tensor,  # [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim], rotated
    out: torch.Tensor,  # [num_tokens, num_heads * head_dim], written for the dense rows
    split: AttentionSplit,
    k_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim] storage, block layout
    v_cache: torch.Tensor,
    block_size: int,
    num_heads: int,
    scale: float,
    tiles: TileAttention | None = None,  # the AMX kernel where it takes these heads (None: torch)
) -> None:
    """Causal attention of each dense chunk over its request's keys."""
    _slots, num_kv_heads, head_dim = k_cache.shape
    q_width, kv_width = num_heads * head_dim, num_kv_heads * head_dim
    for start, end, num_keys, request in split.dense:
        rows = qkv[start:end]
        length = end - start
        q = rows[:, :q_width].view(length, num_heads, head_dim)
        if num_keys == length:  # the whole context is in this step's rows
            k = rows[:, q_width : q_width + kv_width].view(length, num_kv_heads, head_dim)
            v = rows[:, q_width + kv_width : q_width + 2 * kv_width]
            v = v.view(length, num_kv_heads, head_dim)
        else:
            assert split.all_block_tables is not None
            k, v = cached_keys_values(
                k_cache, v_cache, split.all_block_tables[request], num_keys, block_size
            )
            k, v = k.transpose(0, 1), v.transpose(0, 1)
        if tiles is not None:
            tiles.attend(q, k, v, out[start:end].view(length, num_heads, head_dim), scale)
            continue
        q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
        mask = None
        if num_keys != length:  # the causal mask, shifted by the cached keys
            mask = torch.ones(length, num_keys, dtype=torch.bool).tril(num_keys - length)
        attended = F.scaled_dot_product_attention(  # 4-D: CPUs get the fused (flash) kernel
            q[None],
            k[None],
            v[None],
            attn_mask=mask,
            is_causal=mask is None,
            scale=scale,
            enable_gqa=num_kv_heads != num_heads,
        )  # [1, num_heads, length, head_dim]
        out[start:end] = attended[0].transpose(0, 1).reshape(length, q_width)


def cached_keys_values(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,  # [max_blocks] int64
    num_keys: int,
    block_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A request's first `num_keys` keys and values, [num_kv_heads, num_keys, head_dim] each,
    copied out of the block layout (keys [block, head, dim, offset], values [block, head,
    offset, dim])."""
    _slots, num_kv_heads, head_dim = k_cache.shape
    blocks = block_table[: -(-num_keys // block_size)]
    keys = k_cache.view(-1, num_kv_heads, head_dim, block_size).index_select(0, blocks)
    values = v_cache.view(-1, num_kv_heads, block_size, head_dim).index_select(0, blocks)
    keys = keys.permute(1, 0, 3, 2).reshape(num_kv_heads, -1, head_dim)[:, :num_keys]
    values = values.permute(1, 0, 2, 3).reshape(num_kv_heads, -1, head_dim)[:, :num_keys]
    return keys, values

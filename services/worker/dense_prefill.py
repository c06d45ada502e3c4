"""Prompt chunks that are their request's whole context attend with torch's fused attention.

The paged attention kernel (services/worker/kernels) walks a request's cached blocks query by
query: right for decodes and short chunks, slow for a long prompt, whose cost grows with the
square of its length (a 1024-token prompt of SmolLM2-135M spent ~500 of its 727 ms there, on
2 cores in bfloat16, against 229 ms of matmuls). A chunk that starts its request (no cached
prefix: its queries, keys and values are all in this step's qkv rows, rotated) needs no cache
at all: `scaled_dot_product_attention` with a causal mask computes it as blocked matmuls
(oneDNN / flash attention for CPUs). The rest of the step (decodes, continued chunks, prefix
cache hits) goes to the kernel with its own tables.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

DENSE_MIN_QUERIES = 64  # shorter chunks are cheap for the kernel


@dataclass
class AttentionSplit:
    """Which requests of a step attend densely, and the tables of the others."""

    dense: list[tuple[int, int]]  # (first row, end row) of each dense chunk
    paged_rows: torch.Tensor | None  # [n] int64 rows the kernel attends; None: every row
    query_start: torch.Tensor  # the kernel's tables over paged_rows (the step's when all)
    context_lens: torch.Tensor
    block_tables: torch.Tensor

    @property
    def longest_dense(self) -> int:
        return max((end - start for start, end in self.dense), default=0)

    @classmethod
    def of(
        cls,
        query_start: list[int],
        context_lens: list[int],
        block_tables: torch.Tensor,  # [num_requests, max_blocks] int64
    ) -> AttentionSplit:
        dense, paged = [], []
        for index, context_len in enumerate(context_lens):
            start, end = query_start[index], query_start[index + 1]
            if end - start == context_len and context_len >= DENSE_MIN_QUERIES:
                dense.append((start, end))
            else:
                paged.append(index)
        starts = torch.tensor(query_start, dtype=torch.int64)
        lens = torch.tensor(context_lens, dtype=torch.int64)
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
        )


def attend_dense(
    qkv: torch.Tensor,  # [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim], rotated
    out: torch.Tensor,  # [num_tokens, num_heads * head_dim], written for the dense rows
    dense: list[tuple[int, int]],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    scale: float,
) -> None:
    """Causal attention of each dense chunk over itself."""
    q_width, kv_width = num_heads * head_dim, num_kv_heads * head_dim
    for start, end in dense:
        rows = qkv[start:end]
        length = end - start
        q = rows[:, :q_width].view(length, num_heads, head_dim).transpose(0, 1)
        k = rows[:, q_width : q_width + kv_width].view(length, num_kv_heads, head_dim)
        v = rows[:, q_width + kv_width : q_width + 2 * kv_width].view(
            length, num_kv_heads, head_dim
        )
        attended = F.scaled_dot_product_attention(  # 4-D: CPUs get the fused (flash) kernel
            q[None],
            k.transpose(0, 1)[None],
            v.transpose(0, 1)[None],
            is_causal=True,
            scale=scale,
            enable_gqa=num_kv_heads != num_heads,
        )  # [1, num_heads, length, head_dim]
        out[start:end] = attended[0].transpose(0, 1).reshape(length, q_width)

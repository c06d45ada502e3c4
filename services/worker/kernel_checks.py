"""The CUDA path's Triton kernels checked on the worker's own device, against PyTorch's
attention, before the worker relies on them: a Triton build that cannot compile one, or
computes it wrong, leaves its work to the path that was there before it (a warning says so).

    tiles_agree   the tile kernel (services/worker/triton_tiles.py); else prompt chunks go to
                  SDPA one request at a time
    splits_agree  the rows kernel with each row's keys split in ranges, and their merge
                  (services/worker/triton_attention.py); else every row's keys are one range

Both run one small causal case: 40 queries after 100 cached keys of a paged cache whose nine
blocks lie out of order.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from services.worker import triton_attention, triton_tiles
from services.worker.kv_cache import PagedKVCache
from services.worker.row_tables import TILE_QUERIES

log = logging.getLogger(__name__)

BLOCK_SIZE = 16
CACHED, QUERIES = 100, 40
BLOCKS = [5, 0, 8, 2, 7, 1, 4, 6, 3]  # key t sits in slot BLOCKS[t // 16] * 16 + t % 16


@dataclass
class Case:
    """The check's tensors on the device, and PyTorch's answer on the CPU."""

    query: torch.Tensor  # [QUERIES, num_heads, head_dim]
    k_cache: torch.Tensor  # [len(BLOCKS) * BLOCK_SIZE, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [1, len(BLOCKS)] int32
    expected: torch.Tensor  # [QUERIES, num_heads, head_dim] float32, on the CPU

    def int32(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32, device=self.query.device)


def shape(
    model: torch.nn.Module, kv_cache: PagedKVCache
) -> tuple[torch.device, torch.dtype, int, int]:
    """The checks' device, dtype, head_dim and query heads per key/value head, for `model`
    over `kv_cache`."""
    config: Any = model.config
    heads = config.num_attention_heads
    group = heads // getattr(config, "num_key_value_heads", heads)
    cache = kv_cache.keys[0]  # [num_slots, num_kv_heads, head_dim]
    return cache.device, cache.dtype, int(cache.shape[2]), group


def make_case(device: torch.device, dtype: torch.dtype, head_dim: int, group: int) -> Case:
    gen = torch.Generator().manual_seed(0)
    num_kv_heads, total = 2, CACHED + QUERIES
    blocks = torch.tensor(BLOCKS)
    slots = (blocks.repeat_interleave(BLOCK_SIZE) * BLOCK_SIZE + torch.arange(144) % 16)[:total]
    keys = torch.randn(total, num_kv_heads, head_dim, generator=gen)
    values = torch.randn(total, num_kv_heads, head_dim, generator=gen)
    query = torch.randn(QUERIES, num_kv_heads * group, head_dim, generator=gen)
    k_cache = torch.zeros(len(BLOCKS) * BLOCK_SIZE, num_kv_heads, head_dim)
    v_cache = torch.zeros_like(k_cache)
    k_cache[slots], v_cache[slots] = keys, values
    causal = torch.arange(total)[None, :] <= torch.arange(CACHED, total)[:, None]
    expected = F.scaled_dot_product_attention(
        query.transpose(0, 1),
        keys.transpose(0, 1).repeat_interleave(group, 0),
        values.transpose(0, 1).repeat_interleave(group, 0),
        attn_mask=causal,
    ).transpose(0, 1)
    return Case(
        query.to(device, dtype),
        k_cache.to(device, dtype),
        v_cache.to(device, dtype),
        blocks[None, :].to(device, torch.int32),
        expected,
    )


def agree(
    name: str,
    fallback: str,
    case: Case,
    run: Callable[[torch.Tensor], None],
    queries: slice = slice(None),
) -> bool:
    """Whether `run`, writing its output into a zeroed tensor, builds, runs and gives the
    expected attention of `queries` within the dtype's rounding; logs why not."""
    out = torch.zeros_like(case.query)
    try:
        run(out)
        error = (out[queries].float().cpu() - case.expected[queries]).abs().max().item()
    except Exception as exc:  # noqa: BLE001  # any failure to build or run: the fallback
        log.warning("the Triton %s cannot run here, %s: %r", name, fallback, exc)
        return False
    tolerance = 1e-4 if case.query.dtype == torch.float32 else 5e-2
    if not error <= tolerance:
        log.warning("the Triton %s is off by %.3g here, %s", name, error, fallback)
        return False
    return True


def tiles_agree(device: torch.device, dtype: torch.dtype, head_dim: int, group: int) -> bool:
    """The tile kernel, three tiles of 16 queries, built as the worker's steps use it (tiles of
    up to TILE_QUERIES): the check is also that build, before the first step needs it."""
    case = make_case(device, dtype, head_dim, group)
    starts = [0, 16, 32]

    def run(out: torch.Tensor) -> None:
        triton_tiles.attend_tiles(
            out,
            case.query,
            case.k_cache,
            case.v_cache,
            case.int32(starts),
            case.int32([16, 16, 8]),
            case.int32([0, 0, 0]),
            case.int32([CACHED + 1 + start for start in starts]),
            case.block_tables,
            BLOCK_SIZE,
            None,
            None,
            TILE_QUERIES,
        )

    return agree("tile kernel", "prompt chunks go to SDPA", case, run)


def splits_agree(device: torch.device, dtype: torch.dtype, head_dim: int, group: int) -> bool:
    """The rows kernel on the last 8 queries, each a row whose 133 to 140 keys are split in 4
    ranges (the last one empty), and the merge."""
    case = make_case(device, dtype, head_dim, group)
    rows = range(QUERIES - 8, QUERIES)

    def run(out: torch.Tensor) -> None:
        triton_attention.attend_rows(
            out,
            case.query,
            case.k_cache,
            case.v_cache,
            case.int32(list(rows)),
            case.int32([0] * len(rows)),
            case.int32([CACHED + 1 + j for j in rows]),
            case.block_tables,
            BLOCK_SIZE,
            None,
            None,
            splits=4,
        )

    fallback = "each row's keys stay one range"
    return agree("split decode rows", fallback, case, run, slice(rows.start, rows.stop))

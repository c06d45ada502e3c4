"""The paged KV cache: per layer, one key and one value tensor of token slots.

Slot s of a layer holds the key/value of one token: block `s // block_size`, offset
`s % block_size`. The scheduler hands out blocks; the worker writes and reads where the
block tables say (see services/scheduler/block_manager.py for the picture).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from services.worker import huge_pages

log = logging.getLogger(__name__)

CPU_DEFAULT_SHARE = 0.2  # of available RAM for the cache when no budget is given
CPU_DEFAULT_CAP = 2 << 30  # bytes
CUDA_DEFAULT_SHARE = 0.9  # of free device memory after loading the weights


@dataclass(frozen=True)
class CacheShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_token(self) -> int:
        element = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element


def default_budget(device: torch.device) -> int:
    """Bytes the cache may take when the operator gave no --kv-cache-memory."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free * CUDA_DEFAULT_SHARE)
    try:
        with open("/proc/meminfo") as meminfo:
            fields = dict(line.split(":", 1) for line in meminfo)
        available = int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        available = 8 << 30
    return min(int(available * CPU_DEFAULT_SHARE), CPU_DEFAULT_CAP)


def plan_num_blocks(
    shape: CacheShape, block_size: int, budget_bytes: int, max_tokens: int | None
) -> int:
    """Blocks that fit the budget, capped at max_tokens (--max-batch-total-tokens) if set."""
    num_blocks = budget_bytes // (shape.bytes_per_token * block_size)
    if max_tokens is not None:
        num_blocks = min(num_blocks, -(-max_tokens // block_size))
    if num_blocks <= 0:
        raise MemoryError(
            f"KV cache budget of {budget_bytes} bytes holds no block of {block_size} tokens"
        )
    return int(num_blocks)


class PagedKVCache:
    def __init__(
        self,
        shape: CacheShape,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        allocate: bool = True,
        spare_blocks: int = 0,
    ) -> None:
        """allocate=False: block accounting only (the fallback runner keeps the model's own
        caches). spare_blocks: allocated after the num_blocks the scheduler hands out, for the
        backend's own use (CUDA graphs' padding rows)."""
        self.shape = shape
        self.num_blocks = num_blocks
        self.block_size = block_size
        num_slots = (num_blocks + spare_blocks) * block_size if allocate else 0
        # per layer: [num_slots, num_kv_heads, head_dim]
        layer_shape = (num_slots, shape.num_kv_heads, shape.head_dim)
        self.keys = [
            huge_pages.allocate(layer_shape, shape.dtype, device) for _ in range(shape.num_layers)
        ]
        self.values = [
            huge_pages.allocate(layer_shape, shape.dtype, device) for _ in range(shape.num_layers)
        ]
        log.info(
            "KV cache: %d blocks x %d tokens, %.1f MiB on %s%s",
            num_blocks,
            block_size,
            num_blocks * block_size * shape.bytes_per_token / 2**20,
            device,
            "" if allocate else " (accounted; the model keeps its own caches)",
        )

    @staticmethod
    def padded_block_tables(
        block_tables: list[list[int]], context_lens: list[int], block_size: int
    ) -> tuple[list[int], int]:
        """The block tables, each cut to the blocks its context fills and padded with 0 to the
        longest, row-major: ([num_requests * max_blocks] block ids, max_blocks)."""
        used = [-(-length // block_size) for length in context_lens]
        max_blocks = max(used)
        table = [0] * (len(block_tables) * max_blocks)
        for i, (blocks, num_used) in enumerate(zip(block_tables, used, strict=True)):
            table[i * max_blocks : i * max_blocks + num_used] = blocks[:num_used]
        return table, max_blocks

    def slot_range(self, block_ids: list[int], start: int, stop: int) -> list[int]:
        """Slots of a request's tokens start..stop-1, block by block (no tensors: a step packs
        this for every request)."""
        size = self.block_size
        out: list[int] = []
        position = start
        while position < stop:
            first = block_ids[position // size] * size
            end = min(stop, (position // size + 1) * size)
            out.extend(range(first + position % size, first + position % size + end - position))
            position = end
        return out

    def slots(self, block_ids: list[int], num_tokens: int) -> torch.Tensor:
        """Slots of a request's first num_tokens tokens. [num_tokens]"""
        blocks = torch.tensor(block_ids, dtype=torch.long)
        offsets = torch.arange(self.block_size, dtype=torch.long)
        return (blocks[:, None] * self.block_size + offsets[None, :]).flatten()[:num_tokens]

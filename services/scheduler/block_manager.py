"""KV-cache block accounting. The scheduler owns it; the worker only writes where it is told.

The cache is `num_blocks` blocks of `block_size` token slots. A request's block table lists its
blocks in order; token i of the request lives in slot `block_ids[i // block_size] * block_size
+ i % block_size`:

    request tokens:  t0 t1 t2 t3 | t4 t5 t6 t7 | t8 t9      (block_size 4)
    block table:     [   7       |    2        |  5  ]
    slots:           28 29 30 31 | 8  9  10 11 | 20 21
"""

from __future__ import annotations

from collections import deque


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._is_used = [False] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold num_tokens tokens."""
        return -(-num_tokens // self.block_size)

    def num_missing_blocks(self, num_tokens: int, num_held_blocks: int) -> int:
        """Blocks to add to a table of num_held_blocks so it holds num_tokens tokens."""
        return max(0, self.num_blocks_for(num_tokens) - num_held_blocks)

    def can_allocate(self, num_blocks: int, reserve: int = 0) -> bool:
        return num_blocks + reserve <= len(self._free)

    def allocate(self, num_blocks: int) -> list[int]:
        if num_blocks > len(self._free):
            raise MemoryError(f"asked for {num_blocks} blocks, {len(self._free)} free")
        block_ids = [self._free.popleft() for _ in range(num_blocks)]
        for block_id in block_ids:
            self._is_used[block_id] = True
        return block_ids

    def free(self, block_ids: list[int]) -> None:
        for block_id in block_ids:
            if not self._is_used[block_id]:
                raise ValueError(f"block {block_id} freed twice")
            self._is_used[block_id] = False
            self._free.append(block_id)

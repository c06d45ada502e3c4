"""KV-cache block accounting, with automatic prefix caching. The scheduler owns it; the worker
only writes where it is told.

The cache is `num_blocks` blocks of `block_size` token slots. A request's block table lists its
blocks in order; token i of the request lives in slot `block_ids[i // block_size] * block_size
+ i % block_size`:

    request tokens:  t0 t1 t2 t3 | t4 t5 t6 t7 | t8 t9      (block_size 4)
    block table:     [   7       |    2        |  5  ]
    slots:           28 29 30 31 | 8  9  10 11 | 20 21

Prefix caching: a full block is registered, as soon as a step that computes it is planned,
under a hash of its tokens chained with the hash of the block before it, so equal hashes mean
equal prefixes. Blocks are reference counted; a block nobody uses goes to the free list but
keeps its contents and hash until it is handed out again (least recently freed first), so a
later request with the same prefix can take it back without computing it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

BlockHash = int


def block_hashes(
    token_ids: Sequence[int], block_size: int, num_blocks: int, salt: str = ""
) -> list[BlockHash]:
    """Chained hashes of the first num_blocks full blocks of token_ids. `salt` starts the
    chain: the LoRA adapter id, whose keys and values differ from the base model's."""
    hashes: list[BlockHash] = []
    parent = hash(salt) if salt else 0
    for i in range(num_blocks):
        parent = hash((parent, tuple(token_ids[i * block_size : (i + 1) * block_size])))
        hashes.append(parent)
    return hashes


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # LRU
        self._ref_counts = [0] * num_blocks
        self._hash_of: dict[int, BlockHash] = {}  # block -> hash, for cached blocks
        self._block_of: dict[BlockHash, int] = {}  # hash -> block

    @property
    def num_free_blocks(self) -> int:
        """Blocks nobody uses (cached ones included: they are handed out when needed)."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._block_of)

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold num_tokens tokens."""
        return -(-num_tokens // self.block_size)

    def num_missing_blocks(self, num_tokens: int, num_held_blocks: int) -> int:
        """Blocks to add to a table of num_held_blocks so it holds num_tokens tokens."""
        return max(0, self.num_blocks_for(num_tokens) - num_held_blocks)

    def can_allocate(self, num_blocks: int, reserve: int = 0) -> bool:
        return num_blocks + reserve <= len(self._free)

    def allocate(self, num_blocks: int) -> list[int]:
        """Fresh blocks (evicting the least recently freed cached ones)."""
        if num_blocks > len(self._free):
            raise MemoryError(f"asked for {num_blocks} blocks, {len(self._free)} free")
        block_ids = []
        for _ in range(num_blocks):
            block_id, _ = self._free.popitem(last=False)
            cached = self._hash_of.pop(block_id, None)
            if cached is not None:
                del self._block_of[cached]
            self._ref_counts[block_id] = 1
            block_ids.append(block_id)
        return block_ids

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference to each block; unused ones become free (still cached)."""
        for block_id in block_ids:
            if self._ref_counts[block_id] <= 0:
                raise ValueError(f"block {block_id} freed twice")
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                self._free[block_id] = None

    def cached_prefix(self, hashes: list[BlockHash]) -> list[int]:
        """Take a reference to the longest run of cached blocks matching `hashes`."""
        block_ids = []
        for block_hash in hashes:
            block_id = self._block_of.get(block_hash)
            if block_id is None:
                break
            block_ids.append(block_id)
        for block_id in block_ids:
            if self._ref_counts[block_id] == 0:
                del self._free[block_id]
            self._ref_counts[block_id] += 1
        return block_ids

    def register(self, block_id: int, block_hash: BlockHash) -> bool:
        """Mark a full block (computed, or planned in a step) as holding the prefix
        `block_hash`; False where an equal prefix is cached already or the block is."""
        if block_hash in self._block_of or block_id in self._hash_of:
            return False
        self._block_of[block_hash] = block_id
        self._hash_of[block_id] = block_hash
        return True

    def forget(self, block_ids: list[int]) -> None:
        """Drop the blocks' prefixes from the cache (their contents are not what was
        registered); their references stay."""
        for block_id in block_ids:
            block_hash = self._hash_of.pop(block_id, None)
            if block_hash is not None:
                del self._block_of[block_hash]

"""The paged KV cache's slot arithmetic and allocation."""

from __future__ import annotations

import random

import torch

from services.worker.kv_cache import CacheShape, PagedKVCache

SHAPE = CacheShape(num_layers=2, num_kv_heads=3, head_dim=16, dtype=torch.bfloat16)


def test_slot_range_is_the_slice_of_the_request_slots():
    cache = PagedKVCache(SHAPE, num_blocks=64, block_size=16, device=torch.device("cpu"))
    rng = random.Random(0)
    for _ in range(300):
        block_ids = rng.sample(range(64), 10)
        stop = rng.randint(0, 160)
        start = rng.randint(0, stop)
        assert (
            cache.slot_range(block_ids, start, stop)
            == cache.slots(block_ids, stop)[start:stop].tolist()
        )
    #   block 7 holds tokens 0..15, block 2 tokens 16..31: token 15 -> slot 7*16+15
    assert cache.slot_range([7, 2], 14, 18) == [126, 127, 32, 33]


def test_the_cache_is_allocated_zeroed_per_layer():
    cache = PagedKVCache(SHAPE, num_blocks=300, block_size=16, device=torch.device("cpu"))
    assert len(cache.keys) == len(cache.values) == 2
    for tensor in cache.keys + cache.values:
        assert tensor.shape == (300 * 16, 3, 16) and tensor.dtype == torch.bfloat16
        assert not tensor.any()

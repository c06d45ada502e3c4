"""The batched decode attention against a plain softmax(QK^T)V per request, over block tables
in scattered order, in float32 (SDPA path) and bfloat16 (CPU matmul path)."""

from __future__ import annotations

import pytest
import torch

from services.worker.kv_cache import CacheShape, PagedKVCache
from services.worker.paged_attention import _attend_decodes, make_decode_group

BLOCK_SIZE = 4
NUM_KV_HEADS, GROUP, HEAD_DIM = 2, 3, 8
NUM_HEADS = NUM_KV_HEADS * GROUP


def reference(q, keys, values, window):
    """q [heads, dim]; keys/values [len, kv_heads, dim]: one request's attention output."""
    keys, values = keys[-window:] if window else keys, values[-window:] if window else values
    keys = keys.repeat_interleave(GROUP, dim=1).transpose(0, 1)  # [heads, len, dim]
    values = values.repeat_interleave(GROUP, dim=1).transpose(0, 1)
    weights = (q[:, None, :] @ keys.transpose(1, 2) / HEAD_DIM**0.5).softmax(-1)
    return (weights @ values)[:, 0]  # [heads, dim]


@pytest.mark.parametrize(
    ("dtype", "tolerance", "window"),
    [(torch.float32, 1e-5, None), (torch.bfloat16, 2e-2, None), (torch.bfloat16, 2e-2, 5)],
)
def test_decode_group_matches_per_request_attention(dtype, tolerance, window):
    torch.manual_seed(0)
    cache = PagedKVCache(
        CacheShape(1, NUM_KV_HEADS, HEAD_DIM, dtype), 32, BLOCK_SIZE, torch.device("cpu")
    )
    cache.keys[0].copy_(torch.randn_like(cache.keys[0], dtype=torch.float32))
    cache.values[0].copy_(torch.randn_like(cache.values[0], dtype=torch.float32))
    context_lens = [1, 7, 13, 4]
    # scattered blocks, and tables longer than their contexts (blocks reserved ahead)
    block_tables = [[30, 2], [5, 17, 9], [11, 3, 25, 8], [0, 21]]
    rows = [0, 2, 3, 5]  # where each decode query sits in the packed batch
    query = torch.randn(1, NUM_HEADS, 6, HEAD_DIM).to(dtype)
    out = torch.full((6, NUM_HEADS, HEAD_DIM), 7.0, dtype=dtype)
    group = make_decode_group(rows, block_tables, context_lens, BLOCK_SIZE, torch.device("cpu"))
    _attend_decodes(group, query, cache.keys[0], cache.values[0], BLOCK_SIZE, out, None, window)

    for row, blocks, length in zip(rows, block_tables, context_lens, strict=True):
        slots = cache.slots(blocks, length)
        expected = reference(
            query[0, :, row].float(),
            cache.keys[0][slots].float(),
            cache.values[0][slots].float(),
            window,
        )
        assert torch.allclose(out[row].float(), expected, atol=tolerance), row
    untouched = [i for i in range(6) if i not in rows]
    assert (out[untouched] == 7.0).all()  # rows of other requests are left alone

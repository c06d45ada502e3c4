"""The AMX prompt attention kernel (services/worker/kernels/amx_attention.inc) against float32
attention over the same bfloat16 inputs: whole prompts read from a step's qkv rows, chunks
after cached keys read from gathered keys, any GQA group and head dimension it takes, partial
tiles of queries and keys, and scores wide enough to move a row's reference maximum.

It runs where the kernels were built for AMX and Linux grants the tiles; on other CPUs (and
with ATEN_CPU_CAPABILITY below amx) the library has no such kernel and CpuKernels says so."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from services.worker import kernels
from services.worker.kernels.tile_attention import TileAttention


@pytest.fixture(scope="module")
def tiles() -> TileAttention:
    ops = kernels.load()
    if ops is None or ops.tile_attention is None:
        pytest.skip("the CPU kernels here have no AMX tiles")
    return ops.tile_attention


def test_the_kernel_exists_exactly_where_the_amx_matmul_does():
    ops = kernels.load()
    if ops is None:
        pytest.skip("no CPU kernels here")
    assert (ops.tile_attention is not None) == ops.matmul.has_amx
    assert (ops.bf16_attention == "amx") == ops.matmul.has_amx


def reference(q, k, v, scale):
    """float32 causal attention, the queries being the last of the keys' tokens."""
    num_queries, num_keys = q.shape[0], k.shape[0]
    mask = torch.ones(num_queries, num_keys, dtype=torch.bool).tril(num_keys - num_queries)
    attended = F.scaled_dot_product_attention(
        *(t.float().transpose(0, 1)[None] for t in (q, k, v)),
        attn_mask=mask,
        scale=scale,
        enable_gqa=True,
    )
    return attended[0].transpose(0, 1)


def check(tiles, q, k, v, scale):
    out = torch.full_like(q, float("nan")).contiguous()
    tiles.attend(q, k, v, out, scale)
    expected = reference(q, k, v, scale)
    error = (out.float() - expected).abs()
    # P and the output are rounded to bfloat16 (at most 2^-8 of a value each): an output is off
    # by at most 2^-8 of sum(p |v|) / sum(p) twice (P's roundings, and a sum that divides them)
    # and 2^-8 of itself
    weights = reference(q, k, v.abs(), scale)
    bound = 2**-7 * weights + 2**-8 * expected.abs() + 1e-6
    assert torch.isfinite(out.float()).all()
    assert (error <= bound).all(), f"max error {error.max().item():.4g}"
    assert error.sum() < bound.sum() / 2  # roundings average well below their bound


def qkv_rows(num_tokens, num_heads, num_kv_heads, head_dim, spread=1.0):
    """A step's qkv rows [tokens, (heads + 2 kv heads) * head_dim] and views of q, k, v."""
    width = (num_heads + 2 * num_kv_heads) * head_dim
    rows = torch.randn(num_tokens, width) * spread
    rows = rows.to(torch.bfloat16)
    q_width, kv_width = num_heads * head_dim, num_kv_heads * head_dim
    q = rows[:, :q_width].view(num_tokens, num_heads, head_dim)
    k = rows[:, q_width : q_width + kv_width].view(num_tokens, num_kv_heads, head_dim)
    v = rows[:, q_width + kv_width :].view(num_tokens, num_kv_heads, head_dim)
    return q, k, v


@pytest.mark.parametrize("num_tokens", [1, 15, 16, 17, 31, 32, 33, 64, 100, 300])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(9, 3, 64), (4, 4, 32)])
def test_whole_prompts_from_the_steps_rows(tiles, num_tokens, num_heads, num_kv_heads, head_dim):
    torch.manual_seed(num_tokens)
    q, k, v = qkv_rows(num_tokens, num_heads, num_kv_heads, head_dim)
    check(tiles, q, k, v, head_dim**-0.5)


@pytest.mark.parametrize(("num_queries", "num_keys"), [(64, 64), (64, 1000), (70, 1089), (5, 37)])
@pytest.mark.parametrize("head_dim", [32, 128])
def test_chunks_after_cached_keys(tiles, num_queries, num_keys, head_dim):
    """Keys and values as dense_prefill gathers them from the paged cache: [kv heads, keys,
    head_dim], seen transposed (rows head_dim apart, heads keys * head_dim apart)."""
    torch.manual_seed(num_keys)
    num_heads, num_kv_heads = 8, 2
    q, _, _ = qkv_rows(num_queries, num_heads, num_kv_heads, head_dim)
    k, v = torch.randn(2, num_kv_heads, num_keys, head_dim).to(torch.bfloat16)
    check(tiles, q, k.transpose(0, 1), v.transpose(0, 1), head_dim**-0.5)


def test_scores_that_grow_along_the_keys_move_each_rows_reference(tiles):
    """Later keys score far above earlier ones (more than 2^8 apart after the scale), so every
    row's running maximum moves many times; queries of large norm make the softmax sharp."""
    torch.manual_seed(1)
    num_tokens, head_dim = 200, 64
    q, k, v = qkv_rows(num_tokens, 2, 1, head_dim, spread=4.0)
    growth = torch.linspace(0.1, 3.0, num_tokens)[:, None, None]
    k = (k.float() * growth).to(torch.bfloat16)
    scores = q[:, 0].float() @ k[:, 0].float().T * head_dim**-0.5
    assert (scores.max() - scores.min()).item() > 100  # far past RESCALE_LOG2
    check(tiles, q, k, v, head_dim**-0.5)


def test_rows_spaced_past_their_width_and_heads_it_does_not_take(tiles):
    """q rows strided as in a step's qkv, out rows strided as a slice of the step's output; head
    dimensions not a multiple of 32, or past 256, and float32 stay with torch."""
    assert not tiles.takes(torch.bfloat16, 48) and not tiles.takes(torch.bfloat16, 288)
    assert not tiles.takes(torch.float32, 64) and tiles.takes(torch.bfloat16, 96)
    torch.manual_seed(2)
    q, k, v = qkv_rows(50, 6, 2, 96)
    wide = torch.zeros(50, 2, 6, 96, dtype=torch.bfloat16)
    out = wide[:, 1]  # rows 2 * 6 * 96 apart
    tiles.attend(q, k, v, out, 96**-0.5)
    error = (out.float() - reference(q, k, v, 96**-0.5)).abs().max().item()
    assert error < 2e-2
    assert wide[:, 0].eq(0).all()  # nothing written beside the rows


def test_no_query_sees_a_later_key(tiles):
    """The last key's value is huge (3e36): every earlier query must give it a weight of
    exactly 0 (a weight as small as 2^-126 would add ~0.04 to its outputs)."""
    torch.manual_seed(3)
    q, k, v = qkv_rows(40, 4, 2, 64)
    v[-1] = 3e36
    check(tiles, q, k, v, 64**-0.5)

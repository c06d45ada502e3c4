"""flash-attn on the paged KV cache.

On CPU: the per-step metadata on known inputs, the block-size and kernel choice, and the whole
flash path (runner hook, metadata, cache view, call) with a plain-torch stand-in for
flash_attn_varlen_func that follows its documented semantics (bottom-right causal mask, paged
K/V through the block table) and makes the checks its C++ entry makes. On CUDA (marked gpu,
skipped without a GPU or without flash-attn): the real kernel against the SDPA path, and a
tiny Llama against transformers, greedy, alone and batched.
"""

from __future__ import annotations

import sys
import types
from types import SimpleNamespace

import pytest
import torch

from services.worker import flash_attention
from services.worker.cuda_graphs import CudaPaged
from services.worker.flash_attention import (
    FLASH_ATTN,
    SDPA,
    flash_block_size,
    make_metadata,
)
from services.worker.kv_cache import CacheShape, PagedKVCache
from services.worker.loader import FALLBACK, LoadedModel, load_model
from services.worker.paged_attention import (
    METADATA_KWARG,
    AttentionMetadata,
    make_decode_group,
    paged_attention_forward,
)
from services.worker.runtime import pick_backend
from tests.support.engine_loop import EngineLoop, make_request
from tests.support.reference import greedy_continuation, reference_model

CPU = torch.device("cpu")
CUDA = torch.device("cuda")
HALF = CacheShape(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.float16)
BLOCK = 256
NUM_KV_HEADS, GROUP, HEAD_DIM = 2, 2, 16
NUM_HEADS = NUM_KV_HEADS * GROUP

needs_flash = pytest.mark.skipif(
    not flash_attention.is_available(CUDA), reason="flash-attn with block_table not installed"
)


def varlen_reference(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    block_table=None,
):
    """flash_attn_varlen_func with a block table, in plain torch (float32 inside)."""
    assert block_table is not None and block_table.dtype == torch.int32
    assert block_table.stride(-1) == 1
    assert cu_seqlens_q.dtype == cu_seqlens_k.dtype == torch.int32
    assert cu_seqlens_q.is_contiguous() and cu_seqlens_k.is_contiguous()
    num_blocks, page, kv_heads, head_dim = k.shape
    assert page % 256 == 0 and v.shape == k.shape
    assert q.dtype == k.dtype == v.dtype
    assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1
    batch = cu_seqlens_q.numel() - 1
    assert block_table.shape[0] == batch and cu_seqlens_k.numel() == batch + 1
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    scale = head_dim**-0.5 if softmax_scale is None else softmax_scale
    group = q.shape[1] // kv_heads
    out = torch.zeros_like(q)
    for b in range(batch):
        q_len, k_len = cu_q[b + 1] - cu_q[b], cu_k[b + 1] - cu_k[b]
        assert q_len <= max_seqlen_q and k_len <= max_seqlen_k
        pages = block_table[b, : -(-k_len // page)].long()
        keys = k[pages].reshape(-1, kv_heads, head_dim)[:k_len].float()
        values = v[pages].reshape(-1, kv_heads, head_dim)[:k_len].float()
        keys = keys.repeat_interleave(group, 1).transpose(0, 1)  # [heads, k_len, dim]
        values = values.repeat_interleave(group, 1).transpose(0, 1)
        queries = q[cu_q[b] : cu_q[b + 1]].float().transpose(0, 1)  # [heads, q_len, dim]
        # bottom-right alignment: the last query sits at the last key
        i = torch.arange(q_len, device=q.device)[:, None] + k_len - q_len
        j = torch.arange(k_len, device=q.device)[None, :]
        allowed = torch.ones(q_len, k_len, dtype=torch.bool, device=q.device)
        if causal:
            allowed &= j <= i
        if window_size[0] >= 0:
            allowed &= j >= i - window_size[0]
        if window_size[1] >= 0:
            allowed &= j <= i + window_size[1]
        scores = (queries @ keys.transpose(1, 2)) * scale
        weights = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
        out[cu_q[b] : cu_q[b + 1]] = (weights @ values).transpose(0, 1).to(q.dtype)
    return out


@pytest.fixture
def stand_in(monkeypatch):
    """flash-attn "available" everywhere, answered by varlen_reference; the calls' block tables."""
    calls: list[torch.Tensor] = []

    def counted(*args, **kwargs):
        calls.append(kwargs["block_table"].cpu())
        return varlen_reference(*args, **kwargs)

    monkeypatch.setattr(flash_attention, "_varlen_func", lambda: counted)
    monkeypatch.setattr(flash_attention, "is_available", lambda device, shape=None: True)
    return calls


def test_metadata_on_known_inputs():
    # a 5-token prompt, a decode across a block boundary, a 40-token chunk after 560 cached;
    # tables reserve blocks ahead of the context (9, 5): they are cut
    meta = make_metadata(
        query_start=[0, 5, 6, 46],
        context_lens=[5, 300, 600],
        block_tables=[[4], [7, 2, 9], [1, 3, 8, 5]],
        block_size=256,
        device=CPU,
    )
    assert meta.cu_seqlens_q.tolist() == [0, 5, 6, 46]
    assert meta.cu_seqlens_k.tolist() == [0, 5, 305, 905]
    assert (meta.max_seqlen_q, meta.max_seqlen_k, meta.block_size) == (40, 600, 256)
    assert meta.block_table.tolist() == [[4, 0, 0], [7, 2, 0], [1, 3, 8]]
    for tensor in (meta.cu_seqlens_q, meta.cu_seqlens_k, meta.block_table):
        assert tensor.dtype == torch.int32 and tensor.is_contiguous()


def test_metadata_of_decodes_only_keeps_one_block_each():
    meta = make_metadata([0, 1, 2], [1, 256], [[3, 4], [5, 6]], 256, CPU)
    assert meta.block_table.tolist() == [[3], [5]]
    assert (meta.max_seqlen_q, meta.max_seqlen_k) == (1, 256)


def test_block_size_rounds_up_to_256_only_where_flash_attn_runs(monkeypatch):
    monkeypatch.setattr(flash_attention, "_varlen_func", lambda: varlen_reference)
    assert flash_block_size(16, CUDA, HALF) == 256
    assert flash_block_size(256, CUDA, HALF) == 256
    assert flash_block_size(300, CUDA, HALF) == 512
    assert flash_block_size(512, CUDA, HALF) == 512
    assert flash_block_size(16, CPU, HALF) == 16
    float32 = CacheShape(2, 2, 16, torch.float32)
    assert flash_block_size(16, CUDA, float32) == 16  # flash-attn: fp16/bf16 only
    assert flash_block_size(16, CUDA, CacheShape(2, 2, 12, torch.float16)) == 16
    assert flash_block_size(16, CUDA, CacheShape(2, 2, 512, torch.bfloat16)) == 16
    monkeypatch.setattr(flash_attention, "_varlen_func", lambda: None)  # not installed
    assert flash_block_size(16, CUDA, HALF) == 16


@pytest.fixture
def fresh_probe():
    flash_attention._varlen_func.cache_clear()
    yield
    flash_attention._varlen_func.cache_clear()


@pytest.mark.parametrize(
    ("module", "expected"),
    [
        (None, False),  # not installed
        (lambda q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k: 0, False),
        (lambda q, k, v, cu_q, cu_k, max_q, max_k, block_table=None: 0, True),
    ],
    ids=["missing", "no-block-table", "paged"],
)
def test_availability_needs_a_flash_attn_with_block_table(
    monkeypatch, fresh_probe, module, expected
):
    fake = None
    if module is not None:
        fake = types.ModuleType("flash_attn")
        fake.flash_attn_varlen_func = module
    monkeypatch.setitem(sys.modules, "flash_attn", fake)
    assert flash_attention.is_available(CUDA) is expected
    assert flash_attention.is_available(CUDA, HALF) is expected
    assert flash_attention.is_available(CPU) is False


def test_backend_choice(stand_in):
    """With flash-attn (the stand-in: available everywhere), a paged model runs CudaPaged on it,
    its pages 256 tokens long; a model on its own cache does not."""

    model = torch.nn.Linear(2, 2)  # the backends only keep it
    model.base_model = SimpleNamespace(forward=lambda input_ids, position_ids=None: None)

    def loaded(runner="paged", device=CUDA, shape=HALF):
        return LoadedModel(model, None, shape, [2], 512, device, runner)  # type: ignore[arg-type]

    flash = pick_backend(loaded())
    assert isinstance(flash, CudaPaged) and flash.name == FLASH_ATTN and flash.flash
    assert flash.block_size(16, CUDA, HALF) == 256
    fallback = pick_backend(loaded(runner=FALLBACK))
    assert fallback.name == SDPA and not fallback.uses_paged_cache
    assert fallback.block_size(16, CUDA, HALF) == 16


# (q_len, context_len, block ids): a fresh prompt, a decode across a block boundary, a chunk
# after 560 cached tokens, a decode of a one-token prompt, a decode at a full block (in block
# 0, which the tables' padding also names); scattered blocks, some reserved ahead
MIXED = [
    (5, 5, [6, 11]),
    (1, 300, [7, 2, 9]),
    (40, 600, [1, 3, 8, 5]),
    (1, 1, [10]),
    (1, 256, [0, 4]),
]
DECODES_ONLY = [entry for entry in MIXED if entry[0] == 1]


def both_paths(batch, dtype, device, window):
    """One layer's attention output of `batch` on the SDPA path and on the flash path."""
    torch.manual_seed(0)
    cache = PagedKVCache(CacheShape(1, NUM_KV_HEADS, HEAD_DIM, dtype), 12, BLOCK, device)
    cache.keys[0].copy_(torch.randn(cache.keys[0].shape))  # the earlier tokens' keys
    cache.values[0].copy_(torch.randn(cache.values[0].shape))
    query_start, context_lens, new_slots, context_slots = [0], [], [], []
    for q_len, context_len, blocks in batch:
        slots = cache.slots(blocks, context_len)
        new_slots.append(slots[context_len - q_len :])
        context_slots.append(slots.to(device))
        context_lens.append(context_len)
        query_start.append(query_start[-1] + q_len)
    decodes = [i for i, entry in enumerate(batch) if entry[0] == 1]
    meta = AttentionMetadata(
        kv_cache=cache,
        slot_mapping=torch.cat(new_slots).to(device),
        query_start=query_start,
        context_lens=context_lens,
        context_slots=context_slots,
        decodes=make_decode_group(
            [query_start[i] for i in decodes],
            [batch[i][2] for i in decodes],
            [context_lens[i] for i in decodes],
            BLOCK,
            device,
        ),
        prefill_indices=[i for i in range(len(batch)) if i not in decodes],
    )
    num_tokens = query_start[-1]
    query = torch.randn(1, NUM_HEADS, num_tokens, HEAD_DIM).to(device, dtype)
    key = torch.randn(1, NUM_KV_HEADS, num_tokens, HEAD_DIM).to(device, dtype)
    value = torch.randn(1, NUM_KV_HEADS, num_tokens, HEAD_DIM).to(device, dtype)
    layer = SimpleNamespace(layer_idx=0)
    tables = [blocks for *_, blocks in batch]
    outputs = []
    for flash in (None, make_metadata(query_start, context_lens, tables, BLOCK, device)):
        meta.flash = flash  # the same keys/values are written again: the cache is the same
        kwargs = {"scaling": 0.3, "sliding_window": window, METADATA_KWARG: meta}
        out, _ = paged_attention_forward(layer, query, key, value, None, **kwargs)
        outputs.append(out[0].float())  # [num_tokens, num_heads, head_dim]
    return outputs


@pytest.mark.parametrize("window", [None, 50])
@pytest.mark.parametrize("batch", [MIXED, DECODES_ONLY], ids=["mixed", "decodes"])
def test_flash_path_matches_sdpa_path_with_the_stand_in(stand_in, batch, window):
    sdpa, flash = both_paths(batch, torch.float32, CPU, window)
    assert len(stand_in) == 1
    assert torch.allclose(flash, sdpa, atol=1e-5)


def prompts(lengths: list[int], vocab: int = 300) -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [[1] + torch.randint(3, vocab, (n - 1,), generator=gen).tolist() for n in lengths]


def check_alone_and_batched(loaded, reference) -> None:
    """Greedy tokens of the engine on `loaded` equal `reference`'s generate, one request at a
    time and all together (chunked prefill, a prompt across a 256-token page boundary)."""
    engine = EngineLoop(loaded, num_blocks=8, block_size=16, max_batch_prefill_tokens=64)
    assert engine.runner.attention == FLASH_ATTN
    assert engine.runner.kv_cache.block_size == engine.scheduler.config.block_size == 256
    requests = [
        make_request(p, max_new_tokens=n)
        for p, n in zip(prompts([3, 40, 300, 17]), [20, 12, 16, 24], strict=True)
    ]
    expected = {
        r.request_id: greedy_continuation(
            reference, r.input_ids, r.stopping.max_new_tokens, loaded.eos_token_ids
        )
        for r in requests
    }
    for request in requests:
        engine.add(request)
        engine.run()
        assert engine.tokens[request.request_id] == expected[request.request_id]
    together = [make_request(r.input_ids, r.stopping.max_new_tokens) for r in requests]
    for request in together:
        engine.add(request)
    engine.run()
    for request, original in zip(together, requests, strict=True):
        assert engine.tokens[request.request_id] == expected[original.request_id]
    assert max(engine.step_sizes) > 1
    assert engine.scheduler.blocks.num_free_blocks == 8


def test_engine_on_the_flash_path_matches_transformers_with_the_stand_in(stand_in, tiny_llama):
    loaded = load_model(str(tiny_llama), device="cpu")
    check_alone_and_batched(loaded, reference_model(tiny_llama))
    assert stand_in, "the flash path never ran"
    assert max(table.shape[1] for table in stand_in) >= 2  # a context over two pages
    assert max(table.shape[0] for table in stand_in) > 1  # several requests in one call


@pytest.mark.gpu
@needs_flash
@pytest.mark.parametrize("window", [None, 50])
@pytest.mark.parametrize("batch", [MIXED, DECODES_ONLY], ids=["mixed", "decodes"])
@pytest.mark.parametrize(
    ("dtype", "tolerance"), [(torch.float16, 5e-3), (torch.bfloat16, 3e-2)], ids=["fp16", "bf16"]
)
def test_flash_kernel_matches_sdpa_path(batch, window, dtype, tolerance):
    sdpa, flash = both_paths(batch, dtype, CUDA, window)
    assert torch.allclose(flash, sdpa, atol=tolerance), (flash - sdpa).abs().max()


@pytest.mark.gpu
@needs_flash
def test_tiny_llama_on_flash_attn_is_greedy_equal_to_transformers(tiny_llama):
    from transformers import AutoModelForCausalLM

    loaded = load_model(str(tiny_llama), dtype="float16", device="cuda")
    reference = AutoModelForCausalLM.from_pretrained(
        tiny_llama, dtype=torch.float16, attn_implementation="sdpa"
    )
    check_alone_and_batched(loaded, reference.to(CUDA).eval())

"""Huge-page memory for what the CPU kernels stream: the packed weights' arena and the KV
cache's allocation."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import transformers as T

from services.worker import fast_decoder, huge_pages
from services.worker.huge_pages import HUGE_PAGE, HugePageArena
from services.worker.packed_linear import PackedLinear

# Linux with transparent huge pages built in: madvise(MADV_HUGEPAGE) marks the mapping "hg"
HAS_THP = sys.platform.startswith("linux") and Path("/sys/kernel/mm/transparent_hugepage").exists()


def vm_flags(address: int) -> list[str]:
    """The VmFlags of this process's mapping that holds `address`."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(part, 16) for part in head.split("-"))
                inside = start <= address < end
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def test_the_arena_keeps_equal_contiguous_aligned_copies():
    arena = HugePageArena(chunk_bytes=4 << 20)
    torch.manual_seed(0)
    originals = [
        torch.randn(1000, 33).to(torch.bfloat16),  # 66,000 bytes: not a multiple of 64
        torch.randn(7, 5),
        torch.randn(3, 4, 5).transpose(0, 2),  # not contiguous
        torch.randn(1 << 20),  # 4 MiB: fills a chunk of its own
        torch.randn(129, 2),
    ]
    kept = [arena.keep(tensor) for tensor in originals]
    for original, copy in zip(originals, kept, strict=True):
        assert copy.dtype == original.dtype and copy.shape == original.shape
        assert copy.is_contiguous() and torch.equal(copy, original)
        assert copy.data_ptr() != original.data_ptr()
        assert copy.data_ptr() % huge_pages.ALIGN == 0
    # laid one after the other, none overlapping
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in kept)
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:], strict=False))
    assert arena.num_bytes == sum(t.numel() * t.element_size() for t in originals)
    # the first two share the first chunk; the 4 MiB one needed another
    assert kept[1].data_ptr() - kept[0].data_ptr() < 4 << 20
    first_chunk = kept[0].data_ptr()
    assert first_chunk % HUGE_PAGE == 0  # a chunk starts on a huge page
    original = originals[0].clone()
    kept[0].add_(1)  # a copy: the original is untouched
    assert torch.equal(originals[0], original)


@pytest.mark.skipif(not HAS_THP, reason="madvise(MADV_HUGEPAGE) needs Linux with THP built in")
def test_arena_chunks_and_the_kv_cache_are_advised_huge_pages():
    arena = HugePageArena(chunk_bytes=4 << 20)
    kept = arena.keep(torch.randn(1000))
    assert arena.advised_bytes == 4 << 20
    assert "hg" in vm_flags(kept.data_ptr())
    tensor = huge_pages.allocate((3 << 20,), torch.float32, torch.device("cpu"))  # 12 MiB
    middle = tensor.data_ptr() + tensor.numel() * 2  # inside a whole huge page of it
    assert "hg" in vm_flags(middle) and not tensor.any()


@pytest.fixture
def own_dtype(ops) -> torch.dtype:
    """A dtype that a matmul of textgen's own takes at this level: float32 from AVX2 up
    (below AVX2 oneDNN packs every weight)."""
    for dtype in (torch.float32, torch.bfloat16):
        if ops.matmul.takes(torch.empty(8, 64, dtype=dtype)):
            return dtype
    pytest.skip(f"no matmul of textgen's own at the {ops.level} level")


def test_own_kernels_packed_weights_go_to_the_arena_they_are_given(ops, own_dtype):
    dtype = own_dtype
    arena = HugePageArena()
    weight = torch.randn(48, 64).to(dtype)
    linear = PackedLinear(weight, None, ops, arena=arena)
    alone = PackedLinear(weight, None, ops)
    assert linear.own is not None
    assert arena.num_bytes == linear.packed.numel() * linear.packed.element_size() > 0
    assert torch.equal(linear.packed, alone.packed)
    x = torch.randn(5, 64).to(dtype)
    assert torch.equal(linear(x), alone(x))
    expected = (x.float() @ weight.float().T).to(dtype)
    torch.testing.assert_close(linear(x), expected, rtol=2e-2, atol=2e-2)


def test_the_fast_decoder_keeps_its_packed_weights_in_its_arena(ops, own_dtype):
    config = T.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        vocab_size=100,
    )
    model = T.LlamaForCausalLM(config).to(own_dtype)
    decoder = fast_decoder.build(model, torch.device("cpu"), None, 1, ops)
    assert decoder is not None
    linears = [decoder.lm_head] + [
        linear
        for layer in decoder.layers
        for linear in (layer.qkv, layer.o, layer.gate_up, layer.down)
    ]
    own = [linear for linear in linears if linear.own is not None]
    assert len(own) == 9  # the 2 layers' 4 and lm_head
    assert decoder.arena.num_bytes == sum(
        linear.packed.numel() * linear.packed.element_size() for linear in own
    )

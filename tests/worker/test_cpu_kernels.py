"""The CPU kernels (services/worker/kernels) against transformers' and torch's own ops.

The element-wise kernels must round exactly as transformers' modules do (bit-equal in
bfloat16, where every op rounds); the norm's mean of squares sums in another order than
torch's, and both orders follow the vector width (AVX2 or AVX512), so its bound is one that
holds on every x86-64 with AVX2: a few float32 ulps, and in bfloat16 (where those ulps can
tip a rounding) at most 2 bfloat16 ulps on under 1% of the elements. Attention must equal SDPA
over the same keys for any mix of decodes and prompt chunks, block size, GQA group and
sliding window."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from services.worker import kernels

DTYPES = [torch.float32, torch.bfloat16]


def test_the_library_is_built_once_and_reused(ops):
    compiler = kernels._compiler()
    assert compiler is not None
    path = kernels._library_path(compiler, ops.level)
    assert path.exists() and path.parent == kernels.cache_dir()
    # same source, compiler, CPU and instruction set: same file; another set: another file
    assert kernels._library_path(compiler, ops.level) == path
    assert kernels._library_path(compiler, "default") != kernels._library_path(compiler, "avx2")
    assert kernels.load() is ops


AVX512_HOST = "flags : fpu sse2 avx avx2 fma avx512f avx512bw avx512vl avx512_bf16"
AMX_HOST = AVX512_HOST + " amx_tile amx_bf16 amx_int8"
AVX2_HOST = "flags : fpu sse2 avx avx2 fma f16c"


@pytest.mark.parametrize(
    ("host", "requested", "level"),
    [
        (AVX512_HOST, None, "avx512"),
        (AVX512_HOST, "avx2", "avx2"),  # the suite's AVX2 run on an AVX512 host
        (AVX512_HOST, "AVX2", "avx2"),
        (AVX512_HOST, "default", "default"),
        (AVX512_HOST, "avx512_bf16", "avx512"),
        (AVX512_HOST, "nonsense", "avx512"),  # unknown: ignored, as torch ignores it
        (AVX512_HOST, "amx", "avx512"),
        (AMX_HOST, None, "amx"),
        (AMX_HOST, "avx512", "avx512"),  # the AVX512 path of an AMX host: no tiles
        (AMX_HOST, "avx512_bf16", "avx512"),
        (AMX_HOST, "avx2", "avx2"),
        (AVX2_HOST, None, "avx2"),
        (AVX2_HOST, "avx512", "avx2"),  # never above what the CPU has
        (AVX2_HOST, "default", "default"),
        ("flags : fpu sse2 sse4_2", None, "default"),
    ],
)
def test_the_instruction_set_is_the_cpus_capped_by_aten_cpu_capability(
    monkeypatch, host, requested, level
):
    monkeypatch.setattr(kernels.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(kernels, "_cpu_identity", lambda: host)
    if requested is None:
        monkeypatch.delenv(kernels.CAPABILITY_ENV, raising=False)
    else:
        monkeypatch.setenv(kernels.CAPABILITY_ENV, requested)
    assert kernels.capability() == level


def test_the_loaded_kernels_follow_aten_cpu_capability(ops):
    """The kernels this suite runs were built for what this process asks (the whole suite
    runs the AVX2 path under ATEN_CPU_CAPABILITY=avx2, on any host)."""
    assert ops.level == kernels.capability()
    assert kernels.march("avx2") == "-march=x86-64-v3"


def test_no_compiler_means_no_kernels_not_a_crash(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # nothing built there yet
    monkeypatch.setenv("CC", "false")  # a "compiler" that always fails
    assert kernels.load.__wrapped__() is None
    monkeypatch.setattr(kernels, "_compiler", lambda: None)
    assert kernels.load.__wrapped__() is None


def assert_rounded_alike(got: torch.Tensor, expected: torch.Tensor) -> None:
    """bfloat16 results of one float32 computation summed in two orders: a few float32 ulps
    apart before rounding, so a rare element rounds the other way (1 ulp, 2 once the weight
    multiplies it); 2 ulps are at most 2**-6 of the value."""
    expected = expected.detach()
    torch.testing.assert_close(got.float(), expected.float(), rtol=2**-6, atol=1e-30)
    num_different = int((got != expected).sum())
    assert num_different <= 0.01 * got.numel(), f"{num_different} of {got.numel()} differ"


# widths that are whole vectors of 8 and 16 floats, and one whose last 4 run one at a time
@pytest.mark.parametrize("dim", [576, 100])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_equals_transformers_with_and_without_the_residual(ops, dtype, dim):
    torch.manual_seed(0)
    norm = LlamaRMSNorm(dim, eps=1e-5)
    norm.weight.data = torch.randn(dim)
    norm = norm.to(dtype)
    x = (torch.randn(37, dim) * 3).to(dtype)
    residual = torch.randn(37, dim).to(dtype)
    summed = residual + x  # the decoder layer's skip connection, rounded as transformers does
    expected = norm(summed)
    got = ops.rms_norm(x, norm.weight.data, 1e-5, residual=residual)
    assert torch.equal(residual, summed)  # the running sum is left in `residual`
    plain = ops.rms_norm(x, norm.weight.data, 1e-5)
    if dtype == torch.bfloat16:
        assert_rounded_alike(got, expected)
        assert_rounded_alike(plain, norm(x))
    else:  # the mean of squares sums in another order: a few ulps
        torch.testing.assert_close(got, expected, rtol=4e-7, atol=1e-6)
        torch.testing.assert_close(plain, norm(x), rtol=4e-7, atol=1e-6)


@pytest.mark.parametrize("width", [1536, 1000])  # 1000: a span of 488, its last 8 one at a time
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_equals_transformers_mlp_activation(ops, dtype, width):
    torch.manual_seed(1)
    gate_up = (torch.randn(33, 2 * width) * 4).to(dtype)
    gate, up = gate_up[:, :width], gate_up[:, width:]
    expected = F.silu(gate) * up
    got = ops.silu_mul(gate_up)
    if dtype == torch.bfloat16:
        assert torch.equal(got, expected)
    else:  # exp within 2 ulps of torch's
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


def rope(num_tokens: int, head_dim: int, positions: torch.Tensor, dtype: torch.dtype):
    inverse = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = positions[:, None].float() * inverse[None]
    both = torch.cat([angles, angles], -1)
    return both.cos().to(dtype), both.sin().to(dtype)


def read_block_layout(cache: torch.Tensor, slots: torch.Tensor, block_size: int, is_key: bool):
    """The tokens at `slots` from a cache in the fast decoder's block layout."""
    num_slots, kv_heads, head_dim = cache.shape
    if is_key:  # [num_blocks, kv_heads, head_dim, block_size]
        blocks = cache.view(num_slots // block_size, kv_heads, head_dim, block_size)
        return torch.stack([blocks[s // block_size, :, :, s % block_size] for s in slots.tolist()])
    blocks = cache.view(num_slots // block_size, kv_heads, block_size, head_dim)
    return torch.stack([blocks[s // block_size, :, s % block_size] for s in slots.tolist()])


@pytest.mark.parametrize("head_dim", [64, 48])  # 48: halves of 24, their last 8 (or none) alone
@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_store_rotates_like_transformers_and_fills_the_cache(ops, dtype, head_dim):
    torch.manual_seed(2)
    num_heads, num_kv_heads, num_tokens, block_size = 9, 3, 21, 16
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim).to(dtype)
    positions = torch.arange(num_tokens) * 3 + 5
    cos, sin = rope(num_tokens, head_dim, positions, dtype)
    q = qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim).transpose(0, 1)
    k = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim]
    k = k.view(num_tokens, num_kv_heads, head_dim).transpose(0, 1)
    v = qkv[:, (num_heads + num_kv_heads) * head_dim :].view(num_tokens, num_kv_heads, head_dim)
    q_rotated, k_rotated = apply_rotary_pos_emb(q[None], k[None], cos[None], sin[None])
    k_cache = torch.zeros(8 * block_size, num_kv_heads, head_dim, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.randperm(8 * block_size)[:num_tokens]
    rotated = qkv.clone()
    ops.rope_store(rotated, cos, sin, k_cache, v_cache, slots, num_heads, block_size)
    got_q = rotated[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    assert torch.equal(got_q, q_rotated[0].transpose(0, 1))
    keys = read_block_layout(k_cache, slots, block_size, is_key=True)
    assert torch.equal(keys, k_rotated[0].transpose(0, 1))
    assert torch.equal(read_block_layout(v_cache, slots, block_size, is_key=False), v)


def attention_case(ops, dtype, block_size, num_heads, num_kv_heads, head_dim, window, seed=3):
    """A step of decodes and prompt chunks over a scattered cache: the kernel's output and
    SDPA's over the same keys. Each request is (queries this step, keys cached after it)."""
    torch.manual_seed(seed)
    requests = [(1, 40), (5, 5), (1, 1), (17, 33), (3, 100), (40, 70), (1, 16)]
    num_blocks = sum(-(-context // block_size) for _, context in requests) + 4
    k_cache = torch.zeros(num_blocks * block_size, num_kv_heads, head_dim, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    free = torch.randperm(num_blocks).tolist()
    tables, query_start, keys, values = [], [0], [], []
    row_len = (num_heads + 2 * num_kv_heads) * head_dim
    for q_len, context in requests:
        table = [free.pop() for _ in range(-(-context // block_size))]
        slots = torch.tensor(
            [table[p // block_size] * block_size + p % block_size for p in range(context)]
        )
        rows = torch.randn(context, row_len).to(dtype)
        ones, zeros = (
            torch.ones(context, head_dim, dtype=dtype),
            torch.zeros(context, head_dim, dtype=dtype),
        )
        ops.rope_store(rows, ones, zeros, k_cache, v_cache, slots, num_heads, block_size)  # as is
        keys.append(rows[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim])
        values.append(rows[:, (num_heads + num_kv_heads) * head_dim :])
        tables.append(table)
        query_start.append(query_start[-1] + q_len)
    width = max(map(len, tables))
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    qkv = torch.randn(query_start[-1], row_len).to(dtype)
    scale = head_dim**-0.5
    got = ops.paged_attention(
        qkv,
        k_cache,
        v_cache,
        torch.tensor(query_start),
        torch.tensor([context for _, context in requests]),
        block_tables,
        block_size,
        num_heads,
        scale,
        window,
    )
    expected = []
    group = num_heads // num_kv_heads
    for i, (q_len, context) in enumerate(requests):
        q = qkv[query_start[i] : query_start[i + 1], : num_heads * head_dim]
        q = q.view(q_len, num_heads, head_dim).transpose(0, 1).float()
        k = keys[i].view(context, num_kv_heads, head_dim).transpose(0, 1).float()
        v = values[i].view(context, num_kv_heads, head_dim).transpose(0, 1).float()
        query_pos = torch.arange(context - q_len, context)[:, None]
        key_pos = torch.arange(context)[None, :]
        mask = key_pos <= query_pos
        if window:
            mask &= key_pos > query_pos - window
        out = F.scaled_dot_product_attention(
            q,
            k.repeat_interleave(group, 0),
            v.repeat_interleave(group, 0),
            attn_mask=mask,
            scale=scale,
        )
        expected.append(out.transpose(0, 1).reshape(q_len, num_heads * head_dim))
    return got, torch.cat(expected)


# the attention's element type, and whether bfloat16 prompt chunks run on dot products
ATTENTION_PATHS = [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)]
ATTENTION_IDS = ["float32", "bfloat16-fma", "bfloat16-dots"]


def use_attention_dots(ops, request, monkeypatch, dots: bool):
    """The kernels whose bfloat16 prompt chunks attend on AVX512-BF16 dot products
    (attention_dot.inc) or on FMAs, whichever this host's would pick: this host's, and for the
    dot products on an AMX host (whose chunks attend on the tiles) the avx512 level's; dots
    skipped where none are built."""
    if dots and not ops.matmul.has_bf16_dot_products:
        ops = request.getfixturevalue("avx512_ops")  # skipped below the avx512 level
        if not ops.matmul.has_bf16_dot_products:
            pytest.skip("no AVX512-BF16 dot products on this CPU")
    monkeypatch.setattr(ops, "bf16_attention_dots", dots)
    return ops


@pytest.mark.parametrize(("dtype", "dots"), ATTENTION_PATHS, ids=ATTENTION_IDS)
@pytest.mark.parametrize("block_size", [16, 32, 5])
@pytest.mark.parametrize("window", [None, 7])
def test_paged_attention_equals_sdpa_for_mixed_steps(
    ops, request, monkeypatch, dtype, dots, block_size, window
):
    ops = use_attention_dots(ops, request, monkeypatch, dots)
    got, expected = attention_case(ops, dtype, block_size, 9, 3, 64, window)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), expected, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize(("dtype", "dots"), ATTENTION_PATHS, ids=ATTENTION_IDS)
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim"),
    [
        *[(4, 4, 16), (4, 2, 16), (32, 8, 128), (12, 2, 128), (16, 1, 64), (6, 2, 48)],
        *[(5, 5, 80), (8, 4, 256)],
    ],
    ids=["mha", "gqa2", "gqa4-128", "gqa6", "mqa-group16", "gqa3-48", "mha-80", "gqa2-256"],
)
def test_paged_attention_any_gqa_group_and_head_dim(
    ops, request, monkeypatch, dtype, dots, num_heads, num_kv_heads, head_dim
):
    ops = use_attention_dots(ops, request, monkeypatch, dots)
    got, expected = attention_case(ops, dtype, 16, num_heads, num_kv_heads, head_dim, None)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), expected, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("dtype", DTYPES)
def test_greedy_takes_the_first_maximum_and_its_log_softmax(ops, dtype):
    torch.manual_seed(4)
    logits = torch.randn(7, 5003).to(dtype)
    logits[3, 100] = logits[3, 4000] = 50.0  # a tie: the first index wins, as torch.argmax
    logits[5, -1] = 60.0  # the very last index
    token_ids, logprobs = ops.greedy(logits)
    reference = logits.float().log_softmax(-1)
    assert token_ids == logits.float().argmax(-1).tolist()
    assert token_ids[3] == 100 and token_ids[5] == 5002
    expected = reference.gather(1, torch.tensor(token_ids)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(logprobs), expected, rtol=1e-5, atol=1e-5)

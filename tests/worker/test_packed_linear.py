"""The fast decoder's linear layers (services/worker/packed_linear.py) against F.linear, on
whichever matmul this host gives them: AMX tiles for bfloat16 where the kernels were built for them
(the amx level), AVX512-BF16 dot products or FMAs of weights widened to float32 (both tested, the
faster serves) for bfloat16 where they were built for those without the tiles (the avx512 level of a
CPU with avx512_bf16: a Zen 4, or an AMX CPU capped to avx512), textgen's float32 kernel where they
were built for AVX2 or AVX512 (the avx2 level, on an AVX2-only host or with
ATEN_CPU_CAPABILITY=avx2, and the avx512 and amx levels; the float32 cases also run on a library
built for the avx2 level on any host), oneDNN otherwise. oneDNN has no bfloat16 matmul on an
AVX2-only CPU: there PackedLinear refuses bfloat16 weights (the fast decoder then declines the
model) and the bfloat16 cases below do not apply."""

from __future__ import annotations

import logging
import platform
import re
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

from services.worker import kernels
from services.worker.kernels import CAPABILITY_ENV
from services.worker.kernels.matmul import BF16_MATMUL_ENV
from services.worker.packed_linear import PackedLinear, pack, supports
from shared.host import cpu_flags
from tests.support.cpu_kernels import build

needs_bfloat16 = pytest.mark.skipif(
    not supports(torch.bfloat16), reason="no bfloat16 matmul on this CPU (AVX2 only)"
)


def _linux_grants_tiles() -> bool:
    """Linux hands a process the AMX tile state on request from 5.16 on."""
    parts = platform.release().split(".")[:2]
    return platform.system() == "Linux" and tuple(int(p) for p in parts if p.isdigit()) >= (5, 16)


def test_the_own_matmuls_run_exactly_where_the_kernels_were_built_for_them(ops):
    assert ops.matmul.has_amx == (ops.level == "amx" and _linux_grants_tiles())
    # the amx level builds the tiles' kernel instead (granted or not)
    assert ops.matmul.has_bf16_avx512 == (ops.level == "avx512")
    has_dot_products = ops.level == "avx512" and "avx512_bf16" in cpu_flags()
    assert ops.matmul.has_bf16_dot_products == has_dot_products
    # float32: AVX2 or AVX512 (with the tiles' kernel beside it at the amx level)
    assert ops.matmul.has_f32 == (ops.level in ("avx2", "avx512", "amx"))
    float32_kind = {"avx2": "avx2", "avx512": "avx512", "amx": "avx512"}.get(ops.level, "onednn")
    assert PackedLinear(torch.zeros(64, 64), ops=ops).kind == float32_kind
    assert PackedLinear(torch.zeros(64, 64)).kind == "onednn"
    if not supports(torch.bfloat16):
        assert not ops.matmul.has_amx
        with pytest.raises(ValueError, match="cannot run torch.bfloat16 matmuls"):
            PackedLinear(torch.zeros(64, 64, dtype=torch.bfloat16), ops=ops)
        return
    bf16 = PackedLinear(torch.zeros(64, 64, dtype=torch.bfloat16), ops=ops)
    dot = "avx512widen" if ops.matmul.bf16_widens else "avx512bf16"
    own = "amx" if ops.matmul.has_amx else dot if ops.matmul.has_bf16_avx512 else None
    assert bf16.kind == (own or "onednn")
    # K that is not a multiple of 32 stays on oneDNN
    assert PackedLinear(torch.zeros(64, 48, dtype=torch.bfloat16), ops=ops).kind == "onednn"
    assert PackedLinear(torch.zeros(64, 64, dtype=torch.bfloat16)).kind == "onednn"


def _assert_bfloat16_rounding(got: torch.Tensor, expected: torch.Tensor, x, weight) -> None:
    """Within an ulp of F.linear's output, or where the terms cancel, float32 rounding of their
    magnitude; and few outputs differ at all."""
    magnitude = x.float().abs() @ weight.float().abs().T
    bound = torch.finfo(torch.bfloat16).eps * expected.float().abs() + 2**-16 * magnitude
    assert bool(((got.float() - expected.float()).abs() <= bound).all())
    assert (got != expected).float().mean().item() < 1e-3


@needs_bfloat16
@pytest.mark.parametrize("num_rows", [1, 7, 12, 13, 16, 17, 25, 32])
@pytest.mark.parametrize(("k", "n"), [(576, 960), (64, 48), (96, 80), (1536, 576)])
@pytest.mark.parametrize("has_bias", [False, True])
def test_bfloat16_outputs_equal_f_linear_at_decode_batch_sizes(bf16_ops, num_rows, k, n, has_bias):
    """Up to 32 rows the AMX kernel (and oneDNN, on a CPU with bfloat16 instructions) sum K
    in the order F.linear does: bit-equal outputs, for any N (padded to the kernel's 32
    columns) and with a bias. The AVX512-BF16 kernel sums K in its own order (blocks of 12
    rows and the rest): equal within rounding, by dot products or widened; so does oneDNN on
    an AVX512 CPU without AVX512-BF16 (an Emerald Rapids that hides them: its packed weight
    and F.linear's block K otherwise, one output in 10^4 an ulp apart)."""
    generator = torch.Generator().manual_seed(num_rows * 1000 + n)
    weight = (torch.randn(n, k, generator=generator) * 0.05).bfloat16()
    bias = torch.randn(n, generator=generator).bfloat16() if has_bias else None
    x = torch.randn(num_rows + 3, k + 8, generator=generator).bfloat16()[3:, 4 : k + 4]
    linear = PackedLinear(weight, bias, bf16_ops)  # x: not at offset 0, rows k + 8 apart
    got, expected = linear(x), F.linear(x, weight, bias)
    assert got.dtype == torch.bfloat16 and got.shape == (num_rows, n)
    is_exact = linear.kind == "amx" or (linear.kind == "onednn" and "avx512_bf16" in cpu_flags())
    if is_exact:
        assert torch.equal(got, expected)
    else:
        _assert_bfloat16_rounding(got, expected, x, weight)
        assert torch.equal(got, linear(x.contiguous()))  # the stride changes nothing


@needs_bfloat16
@pytest.mark.parametrize("num_rows", [33, 64, 300, 600])
def test_bfloat16_prompt_rows_differ_from_f_linear_by_rounding_only(bf16_ops, num_rows):
    """Past 32 rows oneDNN blocks its sums otherwise: a few outputs in 10^4 move by about an
    ulp."""
    generator = torch.Generator().manual_seed(num_rows)
    weight = (torch.randn(960, 576, generator=generator) * 0.05).bfloat16()
    x = torch.randn(num_rows, 576, generator=generator).bfloat16()
    got, expected = PackedLinear(weight, None, bf16_ops)(x), F.linear(x, weight)
    _assert_bfloat16_rounding(got, expected, x, weight)


@needs_bfloat16
@pytest.mark.parametrize(
    ("out_features", "num_rows", "own"),
    [
        (576, 1536, True),
        (1024, 700, True),
        (576, 1537, False),
        (3072, 512, True),
        (3072, 513, False),
    ],
)
def test_amx_prompt_rows_go_to_onednn_past_the_products_limit(
    bf16_ops, out_features, num_rows, own
):
    """On AMX, prompt chunks past 512 rows go to oneDNN (the weight unpacked), past 1536 rows for
    products of at most 1024 outputs, which oneDNN runs slowly below that: F.linear's output up
    to rounding either way."""
    generator = torch.Generator().manual_seed(num_rows)
    weight = (torch.randn(out_features, 576, generator=generator) * 0.05).bfloat16()
    linear = PackedLinear(weight, None, bf16_ops)
    if linear.kind != "amx":
        pytest.skip(f"{linear.kind} runs every row count")
    x = torch.randn(num_rows, 576, generator=generator).bfloat16()
    unpack = linear.own.unpack
    with mock.patch.object(linear.own, "unpack", side_effect=unpack) as unpacked:
        got = linear(x)
    assert unpacked.called != own
    _assert_bfloat16_rounding(got, F.linear(x, weight), x, weight)


@needs_bfloat16
@pytest.mark.parametrize(("in_features", "num_rows"), [(576, 1100), (1536, 700)])
def test_own_bfloat16_kernel_takes_rows_past_its_chunks(bf16_ops, in_features, num_rows):
    """The own kernel called with more rows than PackedLinear hands it, over several of its row
    chunks (the AMX one's: 512 rows at 576 inputs, 320 at 1536), a last chunk and a last
    tile short: F.linear's outputs up to rounding."""
    generator = torch.Generator().manual_seed(num_rows)
    weight = (torch.randn(96, in_features, generator=generator) * 0.05).bfloat16()
    x = torch.randn(num_rows, in_features, generator=generator).bfloat16()
    linear = PackedLinear(weight, None, bf16_ops)
    if linear.own is None:
        pytest.skip("oneDNN runs this weight here")
    got = linear.own.linear(x, linear.packed, None, linear.out_features)
    _assert_bfloat16_rounding(got, F.linear(x, weight), x, weight)


@needs_bfloat16
@pytest.mark.parametrize("num_rows", [1, 12, 13, 61, 300])
@pytest.mark.parametrize("gated", [False, True])
def test_the_widened_multiply_equals_the_dot_products_bit_for_bit(
    avx512_ops, no_avx512_bf16_ops, num_rows, gated
):
    """vdpbf16ps adds a pair's odd product, then its even one, each as an FMA rounded to
    nearest even (the ISA's definition); the widened kernel adds the same products in the same
    order: the same outputs, so which one runs changes speed only; and so does a build without
    AVX512-BF16, which also rounds to bfloat16 without vcvtne2ps2bf16. (Denormals aside: the
    dot products flush them, here none occur.)"""
    if not avx512_ops.matmul.has_bf16_dot_products:
        pytest.skip("no AVX512-BF16 dot products on this CPU")
    generator = torch.Generator().manual_seed(num_rows)
    weight = (torch.randn(2 * 768, 576, generator=generator) * 0.05).bfloat16()
    bias = None if gated else torch.randn(2 * 768, generator=generator).bfloat16()
    x = torch.randn(num_rows, 580, generator=generator).bfloat16()[:, 2:578]
    outputs = {}
    for multiply in ("dot", "widen"):
        built = build(**{CAPABILITY_ENV: avx512_ops.level, BF16_MATMUL_ENV: multiply})
        linear = PackedLinear(weight, bias, built, gated=gated)
        assert linear.kind == {"dot": "avx512bf16", "widen": "avx512widen"}[multiply]
        outputs[multiply] = linear.silu_mul(x, built) if gated else linear(x)
    assert torch.equal(outputs["dot"], outputs["widen"])
    linear = PackedLinear(weight, bias, no_avx512_bf16_ops, gated=gated)
    assert linear.kind == "avx512widen"
    without = linear.silu_mul(x, no_avx512_bf16_ops) if gated else linear(x)
    assert torch.equal(without, outputs["dot"])


def test_the_bfloat16_multiply_is_the_one_asked_for_else_the_faster(
    avx512_ops, monkeypatch, caplog
):
    """TEXTGEN_BF16_MATMUL picks dot products or widened FMAs; unset (or a value it does not
    take, with a warning), the library times both on this core once."""
    if not avx512_ops.matmul.has_bf16_dot_products:
        pytest.skip("no AVX512-BF16 dot products on this CPU")
    caplog.set_level(logging.INFO, logger="services.worker.kernels")
    monkeypatch.setenv(CAPABILITY_ENV, avx512_ops.level)  # capped to it on an AMX host
    monkeypatch.setenv(BF16_MATMUL_ENV, "Widen ")
    widened = kernels.load.__wrapped__()
    assert widened.matmul.kind(torch.bfloat16) == "avx512widen"
    # prompt chunks' attention follows: the FMAs too, or the dot products too
    assert not widened.bf16_attention_dots and widened.bf16_attention == "widen"
    assert "bfloat16 prompt attention: widen (as the matmuls)" in caplog.text
    monkeypatch.setenv(BF16_MATMUL_ENV, "dot")
    dots = kernels.load.__wrapped__()
    assert dots.matmul.kind(torch.bfloat16) == "avx512bf16"
    assert dots.bf16_attention_dots and dots.bf16_attention == "dot"
    assert "bfloat16 prompt attention: dot (as the matmuls)" in caplog.text
    monkeypatch.setenv(BF16_MATMUL_ENV, "amx")
    caplog.clear()
    chosen = kernels.load.__wrapped__().matmul.bf16_widens
    assert "TEXTGEN_BF16_MATMUL=amx ignored: it takes dot or widen" in caplog.text
    gain = float(re.search(r"widened FMAs x([0-9.]+) the dot products", caplog.text)[1])
    assert gain > 0 and chosen == (gain > 1.0)


@pytest.fixture(params=["host", "avx2"])
def float32_ops(request, ops, avx2_ops):
    """The kernels of this host's level, and those of the avx2 level (the float32 kernel's)."""
    return ops if request.param == "host" else avx2_ops


def _assert_float32_rounding(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias):
    """Within float32 rounding of the exact product: the sums' order differs from F.linear's
    (one FMA per k in textgen's kernel, blocked in oneDNN)."""
    exact = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    magnitude = x.double().abs() @ weight.double().abs().T
    bound = x.shape[1] * torch.finfo(torch.float32).eps * magnitude + 1e-30
    assert got.dtype == torch.float32 and got.shape == exact.shape
    assert bool(((got.double() - exact).abs() <= bound).all())


def test_the_avx2_level_has_the_float32_kernel(avx2_ops):
    assert avx2_ops.matmul.has_f32 and not avx2_ops.matmul.has_amx
    weight = torch.randn(40, 24)
    linear = PackedLinear(weight, ops=avx2_ops)
    assert linear.kind == "avx2" and linear.packed.shape == (3, 24, 16)  # 40 -> 3 panels of 16
    assert torch.equal(linear.packed[2, :, 8:], torch.zeros(24, 8))  # the padding columns
    assert torch.equal(linear.packed[1, 5], weight[16:32, 5])


@pytest.mark.parametrize("num_rows", [1, 2, 5, 6, 7, 13, 32, 61, 300])
@pytest.mark.parametrize(
    ("k", "n"), [(576, 960), (64, 48), (96, 40), (96, 24), (1536, 576), (7, 3)]
)
@pytest.mark.parametrize("has_bias", [False, True])
def test_float32_outputs_are_the_product_within_rounding(float32_ops, num_rows, k, n, has_bias):
    """Any row count (blocks of up to 6 rows on AVX2, 12 on AVX512, as equal as can be), N not a
    multiple of the 16-column panels (the last panel's outputs and bias; on AVX512 a block's
    two panels, the second narrower: N 24), rows that are not adjacent in memory."""
    generator = torch.Generator().manual_seed(num_rows * 1000 + n)
    weight = torch.randn(n, k, generator=generator)
    bias = torch.randn(n, generator=generator) if has_bias else None
    x = torch.randn(num_rows, k + 5, generator=generator)[:, 2 : k + 2]  # rows k + 5 apart
    linear = PackedLinear(weight, bias, float32_ops)
    got = linear(x)
    _assert_float32_rounding(got, x, weight, bias)
    assert torch.equal(got, linear(x.contiguous()))  # the stride changes nothing
    assert torch.equal(got, linear(x.T.contiguous().T))  # nor inputs a column apart


def test_float32_propagates_inf_and_nan(float32_ops):
    weight = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    x = torch.tensor([[float("inf"), 1.0], [float("nan"), 0.0]])
    got = PackedLinear(weight, None, float32_ops)(x)
    assert got[0, 0] == float("inf") and got[0, 1].isnan()  # inf * 0 is NaN
    torch.testing.assert_close(got, F.linear(x, weight), equal_nan=True)


@pytest.mark.parametrize(
    "dtype", [torch.float32, pytest.param(torch.bfloat16, marks=needs_bfloat16)]
)
def test_pack_fuses_linears_that_read_one_input_and_releases_their_weights(ops, dtype):
    torch.manual_seed(0)
    q = torch.nn.Linear(64, 64, bias=True).to(dtype)
    v = torch.nn.Linear(64, 32, bias=False).to(dtype)
    x = torch.randn(5, 64).to(dtype)
    expected = torch.cat([q(x), v(x)], dim=1)
    fused = pack(ops, q, v)
    assert fused.out_features == 96 and fused.in_features == 64
    if dtype == torch.bfloat16:  # bit-equal (see above); float32 may differ in the last bits
        assert torch.equal(fused(x), expected)
    else:
        torch.testing.assert_close(fused(x), expected)
    assert q.weight.numel() == 0 and v.weight.numel() == 0


@pytest.mark.parametrize("num_rows", [1, 5, 12, 13, 32, 61, 300])
@pytest.mark.parametrize(("k", "width"), [(576, 1536), (64, 48), (96, 16)])
def test_float32_gate_up_runs_silu_mul_in_the_matmul(float32_ops, num_rows, k, width):
    """An MLP's gate/up on the float32 kernel: packed with gate and up interleaved a vector at
    a time, silu(gate) * up computed on the sums in registers equals the unfused matmul and
    silu_mul bit for bit, and the plain product ([gate | up], for LoRA) is the unfused one.
    (Where the level has no float32 kernel, oneDNN's product and silu_mul, the same way.)"""
    generator = torch.Generator().manual_seed(num_rows * 1000 + width)
    weight = torch.randn(2 * width, k, generator=generator) / k**0.5
    x = torch.randn(num_rows, k + 5, generator=generator)[:, 2 : k + 2]  # rows k + 5 apart
    gated = PackedLinear(weight, None, float32_ops, gated=True)
    plain = PackedLinear(weight, None, float32_ops)
    assert gated.fuses_silu == float32_ops.matmul.has_f32 and not plain.fuses_silu
    product = plain(x)
    assert torch.equal(gated(x), product)
    activated = gated.silu_mul(x, float32_ops)
    assert activated.shape == (num_rows, width)
    assert torch.equal(activated, float32_ops.silu_mul(product))
    gate, up = product.double().chunk(2, dim=1)
    torch.testing.assert_close(activated.double(), F.silu(gate) * up, rtol=1e-5, atol=1e-6)


@needs_bfloat16
@pytest.mark.parametrize("num_rows", [1, 5, 12, 13, 32, 61, 300])
@pytest.mark.parametrize(("k", "width"), [(576, 1536), (64, 48), (96, 16), (64, 24)])
def test_bfloat16_gate_up_runs_silu_mul_in_the_avx512_bf16_matmul(bf16_ops, num_rows, k, width):
    """On the AVX512-BF16 dot-product kernel an MLP's gate/up is packed with gate and up
    interleaved 16 rows at a time; silu(gate) * up from the sums, rounded to bfloat16 as the
    unfused matmul rounds them, equals that matmul and silu_mul bit for bit, and the plain
    product ([gate | up], for LoRA) is the unfused one. (A width that is no multiple of 16,
    AMX and oneDNN: apart, the same way.)"""
    generator = torch.Generator().manual_seed(num_rows * 1000 + width)
    weight = (torch.randn(2 * width, k, generator=generator) / k**0.5).bfloat16()
    x = torch.randn(num_rows, k + 6, generator=generator).bfloat16()[:, 2 : k + 2]
    gated = PackedLinear(weight, None, bf16_ops, gated=True)
    plain = PackedLinear(weight, None, bf16_ops)
    assert gated.fuses_silu == (bf16_ops.matmul.has_bf16_avx512 and width % 16 == 0)
    assert not plain.fuses_silu
    product = plain(x)
    assert torch.equal(gated(x), product)
    activated = gated.silu_mul(x, bf16_ops)
    assert activated.shape == (num_rows, width) and activated.dtype == torch.bfloat16
    assert torch.equal(activated, bf16_ops.silu_mul(product))
    gate, up = product.double().chunk(2, dim=1)
    torch.testing.assert_close(activated.double(), F.silu(gate) * up, rtol=1e-2, atol=1e-3)


def test_a_gate_up_the_kernel_cannot_fuse_keeps_silu_mul_apart(ops, avx2_ops):
    """A bias, a width that is no multiple of the vector's, or oneDNN: the product as before,
    and silu_mul after it."""
    weight = torch.randn(2 * 40, 32)
    x = torch.randn(3, 32)
    biased = PackedLinear(weight, torch.randn(80), avx2_ops, gated=True)
    assert not biased.fuses_silu
    expected = avx2_ops.silu_mul(biased(x))
    assert torch.equal(biased.silu_mul(x, avx2_ops), expected)
    # 40 is a multiple of AVX2's 8 floats, not of AVX512's 16
    assert PackedLinear(weight, None, avx2_ops, gated=True).fuses_silu
    on_host = PackedLinear(weight, None, ops, gated=True)
    assert on_host.fuses_silu == (ops.matmul.f32_lanes == 8)
    onednn = PackedLinear(weight, None, None, gated=True)
    assert not onednn.fuses_silu
    torch.testing.assert_close(onednn.silu_mul(x, ops), ops.silu_mul(F.linear(x, weight)))

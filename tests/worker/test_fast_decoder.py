"""The fast CPU decoder (services/worker/fast_decoder.py): which models it runs, and that its
logits equal the generic path's (transformers' modules over the paged cache) for the same
packed steps. Greedy parity with transformers' generate, alone and batched, with chunked
prefill, preemption and prefix caching, is in test_runner_parity.py and
test_architectures.py, which run on this decoder by default."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers as T

from services.worker import fast_decoder, kernels
from services.worker.fast_decoder import FAST_DECODER, unsupported_reason
from services.worker.kernels.tile_attention import TileAttention
from services.worker.loader import load_model
from tests.support.engine_loop import EngineLoop, make_request
from tests.support.reference import greedy_continuation
from tests.support.tiny_models import make_tiny_llama
from tests.worker.test_architectures import PAGED, build


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory) -> Path:
    # head_dim 32: the AMX prompt attention kernel's smallest (kernels/tile_attention.py)
    return make_tiny_llama(tmp_path_factory.mktemp("fast") / "llama", num_layers=3, hidden_size=128)


def test_llama_runs_on_the_fast_decoder_unless_disabled(llama_folder):
    fast = load_model(str(llama_folder))
    assert fast.decoder is not None
    assert EngineLoop(fast, num_blocks=16).runner.attention == FAST_DECODER
    # its linear weights moved into the decoder's packed layout
    assert fast.model.model.layers[0].self_attn.q_proj.weight.numel() == 0
    assert fast.kernels is not None and fast.decoder.ops is fast.kernels
    generic = load_model(str(llama_folder), cpu_kernels=False)
    assert generic.decoder is None
    runner = EngineLoop(generic, num_blocks=16).runner
    assert runner.attention == "sdpa"
    assert generic.kernels is None and runner.kernels is None  # greedy sampling skips them too


def logits_of_steps(
    loaded, prompts: list[list[int]], max_new_tokens: int, budget: int = 24
) -> list[torch.Tensor]:
    """The logits every step samples from, for requests joining a running batch with chunked
    prefill (`budget` tokens per step)."""
    engine = EngineLoop(loaded, num_blocks=64, max_batch_prefill_tokens=budget)
    seen: list[torch.Tensor] = []
    forward = engine.runner._forward
    engine.runner._forward = lambda batch: seen.append(forward(batch).float()) or seen[-1]
    for ids in prompts[:2]:
        engine.add(make_request(ids, max_new_tokens))
    engine.step()
    for ids in prompts[2:]:
        engine.add(make_request(ids, max_new_tokens))
    engine.run()
    return seen


def test_fast_logits_equal_the_generic_paths_in_float32(llama_folder):
    prompts = [[1, *range(5, 5 + n)] for n in (3, 40, 9, 25)]
    fast = logits_of_steps(load_model(str(llama_folder)), prompts, 6)
    generic = logits_of_steps(load_model(str(llama_folder), cpu_kernels=False), prompts, 6)
    assert len(fast) == len(generic) > 5
    for got, expected in zip(fast, generic, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
        assert torch.equal(got.argmax(-1), expected.argmax(-1))


def test_fast_logits_equal_the_generic_paths_in_bfloat16(llama_folder):
    """One token per request, so a near-tie broken differently cannot change later inputs."""
    prompts = [[1, *range(5, 5 + n)] for n in (3, 40, 9, 25, 60)]
    fast = torch.cat(logits_of_steps(load_model(str(llama_folder), dtype="bfloat16"), prompts, 1))
    generic = load_model(str(llama_folder), dtype="bfloat16", cpu_kernels=False)
    expected = torch.cat(logits_of_steps(generic, prompts, 1))
    assert fast.shape == expected.shape == (len(prompts), expected.shape[1])
    # both round every op; a float32 sum in another order moves a logit by a few ulps of the
    # largest logits (one ulp is 0.03 between 4 and 8)
    torch.testing.assert_close(fast, expected, rtol=0, atol=0.05 * expected.abs().max().item())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_long_prompt_chunks_attend_densely_with_equal_logits(llama_folder, dtype, monkeypatch):
    """Chunks of 64 tokens and more attend with torch's fused attention, or in bfloat16 on AMX
    tiles where the kernels have them (services/worker/dense_prefill.py), here on every CPU
    (where it is the slower, the policy sends no chunk there): a whole prompt from the step's
    rows, a later chunk from the paged cache; decodes beside them stay on the kernel with
    tables of their own. The logits equal the generic path's."""
    from services.worker import dense_prefill
    from services.worker.dense_prefill import DENSE_MIN_QUERIES, AttentionSplit

    supported = dense_prefill.is_supported
    monkeypatch.setattr(dense_prefill, "min_keys", lambda level, t: 0 if supported(t) else None)

    # two decodes, a chunk after 2 cached tokens (71 queries, 73 keys), a whole prompt of 101
    starts, lens = [0, 1, 2, 73, 174], [20, 30, 73, 101]
    split = AttentionSplit.of(
        starts, lens, torch.zeros(4, 2).long(), torch.tensor(starts), torch.tensor(lens)
    )
    assert split.dense == [(2, 73, 73, 2), (73, 174, 101, 3)]
    assert split.paged_rows.tolist() == [0, 1] and split.context_lens.tolist() == [20, 30]
    gathered, on_tiles = [], []
    gather = dense_prefill.cached_keys_values
    monkeypatch.setattr(
        dense_prefill, "cached_keys_values", lambda *a: gathered.append(a[3]) or gather(*a)
    )
    tile_attend = TileAttention.attend
    monkeypatch.setattr(
        TileAttention,
        "attend",
        lambda self, q, *a: on_tiles.append(len(q)) or tile_attend(self, q, *a),
    )
    prompts = [[1, *range(5, 5 + n)] for n in (3, 9, 70, 200)]
    assert all(len(p) < DENSE_MIN_QUERIES for p in prompts[:2])
    # bfloat16: one token each, so a near-tie broken differently cannot change later inputs
    new_tokens = 4 if dtype == "float32" else 1
    fast = logits_of_steps(load_model(str(llama_folder), dtype=dtype), prompts, new_tokens, 110)
    # some chunk after cached tokens attended densely, where torch's fused attention runs the
    # dtype (bfloat16: not down its AVX2 path; the kernel then attends every chunk)
    assert bool(gathered) == dense_prefill.is_supported(getattr(torch, dtype))
    # bfloat16 chunks attend on AMX tiles where the kernels have them, else in torch
    has_tiles = kernels.load().tile_attention is not None
    assert bool(on_tiles) == (has_tiles and dtype == "bfloat16")
    generic = load_model(str(llama_folder), dtype=dtype, cpu_kernels=False)
    expected = logits_of_steps(generic, prompts, new_tokens, budget=110)
    got, want = torch.cat(fast), torch.cat(expected)
    assert got.shape == want.shape and got.shape[0] >= len(prompts)
    if dtype == "float32":
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    else:
        torch.testing.assert_close(got, want, rtol=0, atol=0.05 * want.abs().max().item())


def test_which_chunks_attend_densely_by_instruction_set():
    """torch's fused attention takes the chunks where it was measured the faster: every chunk
    of 64 queries on AMX, none on AVX512, those over 1024 keys or more on AVX2; the AMX kernel
    from 32 queries."""
    from services.worker import dense_prefill
    from services.worker.dense_prefill import AttentionSplit

    assert dense_prefill.min_keys("amx", torch.float32) == 0
    assert dense_prefill.min_keys("avx512", torch.float32) is None
    assert dense_prefill.min_keys("avx2", torch.float32) == 1024
    assert dense_prefill.min_keys("default", torch.float32) == 1024
    # a decode, a whole prompt of 100, a chunk of 100 queries after 1000 cached tokens
    starts, lens = [0, 1, 101, 201], [20, 100, 1100]
    tables = torch.zeros(3, 2).long()

    def dense(min_keys):
        split = AttentionSplit.of(
            starts, lens, tables, torch.tensor(starts), torch.tensor(lens), min_keys
        )
        return [request for *_, request in split.dense]

    assert dense(0) == [1, 2]
    assert dense(1024) == [2]
    assert dense(None) == []
    # on the AMX kernel chunks of 32 queries or more: a chunk of 40 after 200 cached tokens
    starts, lens = [0, 1, 41], [20, 240]
    split = AttentionSplit.of(
        starts, lens, tables[:2], torch.tensor(starts), torch.tensor(lens), 0, 32
    )
    assert [request for *_, request in split.dense] == [1]
    split = AttentionSplit.of(starts, lens, tables[:2], torch.tensor(starts), torch.tensor(lens), 0)
    assert split.dense == []


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_amx_kernel_takes_chunks_from_32_queries(llama_folder, dtype):
    """Where the kernels have AMX tiles, bfloat16 chunks of 32 queries or more attend densely
    (on the tiles); float32 ones, and every chunk elsewhere, from 64."""
    from services.worker.dense_prefill import DENSE_MIN_QUERIES, TILE_MIN_QUERIES

    decoder = load_model(str(llama_folder), dtype=dtype).decoder
    assert decoder is not None
    on_tiles = kernels.load().tile_attention is not None and dtype == "bfloat16"
    expected = TILE_MIN_QUERIES if on_tiles else DENSE_MIN_QUERIES
    assert decoder.dense_min_queries == expected == (32 if on_tiles else 64)
    assert (decoder.tiles is not None) == on_tiles


def test_heads_the_amx_kernel_does_not_take_stay_in_torch(tmp_path):
    """head_dim 16 is below the AMX kernel's 32: bfloat16 chunks attend in torch, from 64
    queries, on every CPU."""
    from services.worker.dense_prefill import DENSE_MIN_QUERIES

    folder = make_tiny_llama(tmp_path / "llama", hidden_size=64)
    decoder = load_model(str(folder), dtype="bfloat16").decoder
    assert decoder is not None
    assert decoder.tiles is None
    assert decoder.dense_min_queries == DENSE_MIN_QUERIES


def mistral_with_window(vocab_size: int):
    config = PAGED["mistral"](vocab_size)
    config.sliding_window = 12  # shorter than the prompts
    return config


def test_sliding_window_matches_transformers(tmp_path):
    """Mistral with a window shorter than the prompts: the kernel masks keys the window left."""
    folder = build(tmp_path / "mistral", mistral_with_window)
    loaded = load_model(str(folder))
    assert loaded.decoder is not None and loaded.decoder.layers[0].sliding_window == 12
    reference = T.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa").eval()
    prompts = [[1, *range(5, 5 + n)] for n in (30, 50, 80)]
    engine = EngineLoop(loaded, num_blocks=64, max_batch_prefill_tokens=96)
    requests = [make_request(ids, 10) for ids in prompts]
    for request in requests:
        engine.add(request)
    engine.run()
    for request, ids in zip(requests, prompts, strict=True):
        expected = greedy_continuation(reference, ids, 10, [2])
        assert engine.tokens[request.request_id] == expected


def test_models_it_does_not_run_say_why(tmp_path, llama_folder):
    cpu = torch.device("cpu")
    llama = load_model(str(llama_folder), cpu_kernels=False).model
    assert unsupported_reason(llama, cpu, None, 1) is None
    assert "quantized" in unsupported_reason(llama, cpu, "bitsandbytes", 1)
    assert "tensor-parallel" in unsupported_reason(llama, cpu, None, 2)
    assert "CPU only" in unsupported_reason(llama, torch.device("cuda"), None, 1)
    llama.config.hidden_act = "gelu"
    assert "SiLU" in unsupported_reason(llama, cpu, None, 1)
    gpt2 = T.GPT2LMHeadModel(T.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=50))
    assert "gpt2 is not one of" in unsupported_reason(gpt2, cpu, None, 1)
    odd = T.LlamaForCausalLM(
        T.LlamaConfig(hidden_size=64, num_attention_heads=8, num_hidden_layers=1, vocab_size=50)
    )  # head_dim 8, as stories260k
    assert "head dimension 8" in unsupported_reason(odd, cpu, None, 1)
    half = T.LlamaForCausalLM(
        T.LlamaConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=1, vocab_size=50)
    ).to(torch.float16)
    assert "float16" in unsupported_reason(half, cpu, None, 1)
    assert fast_decoder.build(half, cpu, None, 1, kernels.load()) is None
    # bfloat16 where oneDNN has its matmul (AVX512, AMX); an AVX2-only CPU falls back
    bf16 = half.to(torch.bfloat16)  # (Module.to converts `half` in place)
    reason = unsupported_reason(bf16, cpu, None, 1)
    if torch.ops.mkldnn._is_mkldnn_bf16_supported():
        assert reason is None
    else:
        assert "cannot run torch.bfloat16 matmuls" in reason
    assert fast_decoder.build(llama, cpu, None, 1, None) is None  # --disable-cpu-kernels

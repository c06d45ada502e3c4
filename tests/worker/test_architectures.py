"""Architectures beyond Llama: tiny random models of each, greedy parity with transformers'
generate for requests alone and batched together with chunked prefill. Models whose
transformers code bypasses the attention interface (BLOOM, MPT, Falcon) run on the fallback
runner; encoder-decoders are refused with a clear error."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers as T

from services.worker.loader import LoadedModel, UnsupportedModel, load_model
from tests.support.engine_loop import EngineLoop, make_request
from tests.support.tiny_models import make_tiny_llama, train_tokenizer

COMMON = {"bos_token_id": 1, "eos_token_id": 2, "initializer_range": 0.2}
# the Llama-shaped configs' sizes (GQA: 4 heads, 2 key/value heads)
SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    **COMMON,
)
PAGED = {
    "mistral": lambda v: T.MistralConfig(vocab_size=v, **SHAPE),
    "qwen2": lambda v: T.Qwen2Config(vocab_size=v, **SHAPE),
    "gpt_neox": lambda v: T.GPTNeoXConfig(
        vocab_size=v,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=512,
        **COMMON,
    ),
    "opt": lambda v: T.OPTConfig(
        vocab_size=v,
        hidden_size=64,
        ffn_dim=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=512,
        word_embed_proj_dim=64,
        pad_token_id=0,
        **COMMON,
    ),
    "gpt2": lambda v: T.GPT2Config(
        vocab_size=v, n_embd=64, n_layer=2, n_head=4, n_positions=512, **COMMON
    ),
    "gpt_bigcode": lambda v: T.GPTBigCodeConfig(
        vocab_size=v, n_embd=64, n_layer=2, n_head=4, n_positions=512, multi_query=True, **COMMON
    ),
}
FALLBACK = {
    "falcon": lambda v: T.FalconConfig(
        vocab_size=v, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, **COMMON
    ),
    "bloom": lambda v: T.BloomConfig(vocab_size=v, hidden_size=64, n_layer=2, n_head=4, **COMMON),
    "mpt": lambda v: T.MptConfig(vocab_size=v, d_model=64, n_layers=2, n_heads=4, **COMMON),
}


def build(folder: Path, make_config) -> Path:
    folder.mkdir(parents=True)
    vocab_size = train_tokenizer(folder)
    torch.manual_seed(0)
    T.AutoModelForCausalLM.from_config(make_config(vocab_size)).eval().save_pretrained(folder)
    T.GenerationConfig(bos_token_id=1, eos_token_id=2).save_pretrained(folder)
    return folder


def check_parity(folder: Path, runner: str, **load_kwargs) -> LoadedModel:
    loaded = load_model(str(folder), **load_kwargs)
    assert loaded.runner == runner
    reference = T.AutoModelForCausalLM.from_pretrained(folder).eval()
    prompts = [[1, *range(5, 5 + n)] for n in (4, 30, 70)]
    expected = [
        reference.generate(
            torch.tensor([ids]),
            max_new_tokens=12,
            do_sample=False,
            eos_token_id=[2],
            pad_token_id=0,
        )[0, len(ids) :].tolist()
        for ids in prompts
    ]
    alone = []
    for ids in prompts:
        engine = EngineLoop(loaded, num_blocks=64, max_batch_prefill_tokens=32)
        request = make_request(ids, 12)
        engine.add(request)
        engine.run()
        alone.append(engine.tokens[request.request_id])
    assert alone == expected
    engine = EngineLoop(loaded, num_blocks=64, max_batch_prefill_tokens=32)
    requests = [make_request(ids, 12) for ids in prompts]
    for request in requests:
        engine.add(request)
    engine.run()
    assert [engine.tokens[r.request_id] for r in requests] == expected
    assert engine.scheduler.counters.num_prefill_chunks > 0  # chunked prefill happened
    assert max(engine.step_sizes) == 3  # all three in one step at some point
    assert engine.scheduler.blocks.num_free_blocks == 64
    return loaded


FAST_DECODER_MODELS = {"mistral", "qwen2"}  # and llama: Llama-shaped, on the CPU kernels


@pytest.mark.parametrize("name", sorted(PAGED))
def test_paged_greedy_parity(name, tmp_path):
    folder = build(tmp_path / name, PAGED[name])
    check_parity(folder, "paged")
    assert (load_model(str(folder)).decoder is not None) == (name in FAST_DECODER_MODELS)


@pytest.mark.parametrize("name", sorted(FALLBACK))
def test_fallback_greedy_parity(name, tmp_path):
    check_parity(build(tmp_path / name, FALLBACK[name]), "fallback")


def test_llama_is_paged(tmp_path):
    assert load_model(str(make_tiny_llama(tmp_path / "llama"))).runner == "paged"


def build_t5(folder: Path) -> Path:
    """A tiny random FLAN-T5-like model (gated-GELU) with the trained tokenizer."""
    folder.mkdir(parents=True)
    vocab_size = train_tokenizer(folder)
    torch.manual_seed(0)
    config = T.T5Config(
        vocab_size=vocab_size,
        d_model=64,
        d_ff=128,
        d_kv=16,
        num_layers=2,
        num_heads=4,
        decoder_start_token_id=0,
        pad_token_id=0,
        eos_token_id=2,
        feed_forward_proj="gated-gelu",  # FLAN-T5's
        initializer_factor=2.0,  # a random T5 with a narrower init repeats one token
    )
    T.T5ForConditionalGeneration(config).eval().save_pretrained(folder)
    T.GenerationConfig(decoder_start_token_id=0, eos_token_id=2, pad_token_id=0).save_pretrained(
        folder
    )
    return folder


def test_t5_runs_as_seq2seq_with_greedy_parity(tmp_path):
    folder = build_t5(tmp_path / "t5")
    loaded = load_model(str(folder))
    assert loaded.runner == "seq2seq"
    reference = T.T5ForConditionalGeneration.from_pretrained(folder).eval()
    prompts = [[1, *range(5, 5 + n)] for n in (4, 30, 70)]
    expected = [
        reference.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)[0, 1:].tolist()
        for ids in prompts
    ]
    engine = EngineLoop(loaded, num_blocks=64, max_batch_prefill_tokens=32)
    requests = [make_request(ids, 12) for ids in prompts]
    for request in requests:
        engine.add(request)
    engine.run()
    assert [engine.tokens[r.request_id] for r in requests] == expected
    assert all(len(set(tokens)) > 3 for tokens in expected), expected  # not one id repeated
    assert engine.scheduler.counters.num_prefill_chunks > 0
    assert engine.scheduler.blocks.num_free_blocks == 64


def test_models_that_generate_no_text_are_refused(tmp_path):
    folder = tmp_path / "vit"
    folder.mkdir()
    T.ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2).save_pretrained(folder)
    with pytest.raises(UnsupportedModel, match="neither a causal language model"):
        load_model(str(folder))

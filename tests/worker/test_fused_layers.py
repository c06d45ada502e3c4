"""Fused q/k/v and gate/up projections in transformers' modules (services/worker/fused_layers.py):
greedy parity with transformers' generate alone and in a busy batch with chunked prefill, for
each Llama-shaped architecture (biases, sliding windows), the weights held once, the same
logits as the modules unfused, and models that stay unfused."""

from __future__ import annotations

import logging

import pytest
import torch
import transformers as T

from services.worker import fused_layers
from services.worker.fused_layers import FusedLinear
from services.worker.loader import load_model
from tests.worker.test_architectures import PAGED, SHAPE, build, check_parity

MODELS = {
    "llama": lambda v: T.LlamaConfig(vocab_size=v, tie_word_embeddings=False, **SHAPE),
    "llama-biased": lambda v: T.LlamaConfig(vocab_size=v, attention_bias=True, **SHAPE),
    # every key window shorter than the prompts: the fused forward must pass it on
    "mistral-window": lambda v: T.MistralConfig(vocab_size=v, sliding_window=8, **SHAPE),
    # q/k/v biases; a window on the second layer only (Qwen2 keeps it per layer)
    "qwen2-window": lambda v: T.Qwen2Config(
        vocab_size=v, use_sliding_window=True, sliding_window=8, max_window_layers=1, **SHAPE
    ),
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("fused")
    return {name: build(root / name, make) for name, make in MODELS.items()}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_fused_modules_match_generate_alone_and_batched(folders, name):
    loaded = check_parity(folders[name], "paged", cpu_kernels=False)
    assert loaded.decoder is None and loaded.projections_fused
    layer = loaded.model.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, FusedLinear)
    assert isinstance(layer.mlp.gate_up_proj, FusedLinear)
    assert not hasattr(layer.self_attn, "q_proj") and not hasattr(layer.mlp, "up_proj")


def test_weights_are_held_once_and_logits_equal_the_unfused_modules(folders):
    folder = folders["qwen2-window"]
    fused = load_model(str(folder), cpu_kernels=False)
    apart = load_model(str(folder), cpu_kernels=False, fuse_projections=False)
    assert fused.projections_fused and not apart.projections_fused
    count = lambda model: sum(p.numel() for p in model.parameters())  # noqa: E731
    assert count(fused.model) == count(apart.model)
    attention = apart.model.model.layers[1].self_attn
    qkv = fused.model.model.layers[1].self_attn.qkv_proj
    assert qkv.parts == (("q_proj", 64), ("k_proj", 32), ("v_proj", 32))
    assert torch.equal(qkv.weight[64:96], attention.k_proj.weight)
    assert torch.equal(qkv.bias[96:], attention.v_proj.bias)
    # transformers' own attention and KV cache on both: the fused forward is a drop-in
    ids = torch.tensor([[1, *range(5, 45)]])
    outputs = []
    for loaded in (fused, apart):
        loaded.model.set_attn_implementation("sdpa")
        with torch.no_grad():
            logits = loaded.model(ids).logits
            generated = loaded.model.generate(ids, max_new_tokens=8, do_sample=False)
        outputs.append((logits, generated))
    (fused_logits, fused_tokens), (apart_logits, apart_tokens) = outputs
    torch.testing.assert_close(fused_logits, apart_logits, rtol=1e-5, atol=1e-5)
    assert torch.equal(fused_tokens, apart_tokens)


def test_models_that_stay_unfused_say_why(folders, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger=fused_layers.__name__)
    gpt2 = load_model(str(build(tmp_path / "gpt2", PAGED["gpt2"])), cpu_kernels=False)
    assert not gpt2.projections_fused
    assert "projections not fused: gpt2 is not one of llama, mistral, qwen2" in caplog.text
    llama = T.AutoModelForCausalLM.from_pretrained(folders["llama"])
    assert fused_layers.unfusable_reason(llama, "nf4", 1) == "the model is quantized"
    assert "tensor-parallel" in fused_layers.unfusable_reason(llama, None, 2)
    # the fast decoder runs Llama on the CPU kernels: its modules are never fused
    assert not load_model(str(folders["llama"])).projections_fused

"""The decode-ceiling arithmetic (services.bench.ceiling) on a model whose sizes are known."""

from __future__ import annotations

from services.bench.ceiling import bytes_per_step, flops_per_token, format_ceiling


def small_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=100,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(config)


def test_flops_per_token_counts_every_linear_and_the_attention():
    model = small_llama()
    head_dim = 8
    per_layer = 32 * 4 * head_dim + 2 * 32 * 2 * head_dim + 4 * head_dim * 32 + 3 * 32 * 64
    linear = 2 * per_layer + 32 * 100  # the tied lm_head still multiplies
    assert flops_per_token(model, context_len=10) == 2 * linear + 4 * 10 * 4 * head_dim * 2


def test_format_names_the_fraction():
    text = format_ceiling(
        {
            "batch": 32,
            "context_len": 256,
            "dtype": "bfloat16",
            "step_ms": 60.0,
            "achieved_gflops": 150.0,
            "matmul_ceiling_gflops": 900.0,
            "fraction": 0.167,
        }
    )
    assert "0.17 of the 2048^3 matmul ceiling (900 GFLOP/s)" in text
    roofline = {
        "step_ms": 1.25,
        "bytes_per_step": 2_500_000_000,
        "achieved_gbs": 2000.0,
        "copy_gbs": 2900.0,
        "fraction": 0.69,
    }
    text = format_ceiling(
        {
            "batch": 32,
            "context_len": 256,
            "dtype": "bfloat16",
            "step_ms": 6.0,
            "achieved_gflops": 15000.0,
            "matmul_ceiling_gflops": 600000.0,
            "fraction": 0.025,
            "roofline": roofline,
        }
    )
    assert "memory roofline: batch 1, 1.250 ms/step reading 2500 MB = 2000 GB/s" in text
    assert "0.69 of a device copy's 2900 GB/s" in text
    assert (
        format_ceiling({"available": False, "message": "no engine"}) == "decode ceiling: no engine"
    )


def test_bytes_per_step_reads_tied_weights_once_and_the_context():
    model = small_llama()
    distinct = sum(p.numel() for p in model.parameters()) * 4  # parameters() yields ties once
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert bytes_per_step(model, bytes_per_token=512, context_len=10) == distinct + 5120

"""Tiny random-weight models with an in-process trained tokenizer, written as real model folders
(config.json, model.safetensors, tokenizer.json, ...) exactly as a user would have them."""

from __future__ import annotations

import json
from pathlib import Path

WORDS = (
    "the a cat dog bird sat ran jumped over under on in house tree garden little big red blue "
    "happy sad said hello world once upon time there was girl boy named lily tom played with "
    "ball sun moon sky water fish friend mom dad day night went to and but so they she he it"
).split()


def corpus(num_lines: int = 400) -> list[str]:
    """Deterministic pseudo-sentences to train the tokenizer on."""
    lines = []
    for i in range(num_lines):
        n = 5 + (i * 7) % 11
        lines.append(" ".join(WORDS[(i * 13 + j * 17) % len(WORDS)] for j in range(n)) + ".")
    return lines


def train_tokenizer(folder: Path, vocab_size: int = 320) -> int:
    """Train a byte-level BPE tokenizer with <s> prepended, save it with its config (and a
    chat template); return the vocab size."""
    from services.bench.random_model import train_tokenizer as train_bpe

    vocab_size = train_bpe(folder, corpus(), vocab_size)
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "add_bos_token": True,
                "model_max_length": 512,
                "chat_template": (
                    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                    "{% if add_generation_prompt %}<s>assistant:{% endif %}"
                ),
            }
        )
    )
    return vocab_size


def make_tiny_llama(folder: Path, seed: int = 0, num_layers: int = 2) -> Path:
    """A random Llama (GQA, 4 heads / 2 kv heads) with a trained tokenizer."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    vocab_size = train_tokenizer(folder)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        # a wide init spreads the logits, so greedy argmax has no near-ties between runs
        initializer_range=0.2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    model.save_pretrained(folder, safe_serialization=True)
    GenerationConfig(bos_token_id=1, eos_token_id=2).save_pretrained(folder)
    return folder

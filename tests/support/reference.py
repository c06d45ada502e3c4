"""The correctness oracle: transformers' own generate, greedy."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch


@lru_cache(maxsize=4)
def reference_model(folder: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa").eval()


@lru_cache(maxsize=4)
def tokenizer(folder: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def greedy_ids(
    folder: Path, prompt: str, max_new_tokens: int, eos_token_ids: list[int]
) -> list[int]:
    """Greedy continuation of a text prompt (tokenized with special tokens, as /generate)."""
    input_ids = tokenizer(folder)(prompt).input_ids
    return greedy_continuation(reference_model(folder), input_ids, max_new_tokens, eos_token_ids)


def greedy_continuation(
    model, input_ids: list[int], max_new_tokens: int, eos_token_ids: list[int]
) -> list[int]:
    """transformers' greedy `generate` after `input_ids`: the generated ids only."""
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([input_ids], device=model.device),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=eos_token_ids,
            pad_token_id=0,
        )
    return out[0, len(input_ids) :].tolist()

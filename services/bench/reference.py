"""transformers' generate on the same workload: the baseline textgen must beat."""

from __future__ import annotations

import time
from dataclasses import dataclass

from services.bench.workload import Case


@dataclass
class ReferenceResult:
    mode: str  # "sequential" (one request at a time) or "batched" (one padded batch)
    num_generated_tokens: int
    wall_s: float
    token_ids: list[list[int]]

    @property
    def tokens_per_s(self) -> float:
        return self.num_generated_tokens / self.wall_s


def _load(model_id: str, dtype: str):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_id)
    model = AutoModelForCausalLM.from_pretrained(
        model_id, dtype=getattr(torch, dtype), attn_implementation="sdpa"
    ).eval()
    return model, tokenizer


def run_sequential(
    model_id: str, cases: list[Case], eos_token_ids: list[int], dtype: str = "float32"
) -> ReferenceResult:
    """Each request alone, greedy: what a naive server does."""
    import torch

    model, tokenizer = _load(model_id, dtype)
    outputs = []
    started = time.perf_counter()
    with torch.inference_mode():
        for case in cases:
            input_ids = tokenizer(case.prompt, return_tensors="pt").input_ids
            out = model.generate(
                input_ids,
                max_new_tokens=case.max_new_tokens,
                do_sample=False,
                eos_token_id=eos_token_ids,
                pad_token_id=0,
            )
            outputs.append(out[0, input_ids.shape[1] :].tolist())
    wall_s = time.perf_counter() - started
    return ReferenceResult("sequential", sum(map(len, outputs)), wall_s, outputs)


def run_batched(
    model_id: str,
    cases: list[Case],
    eos_token_ids: list[int],
    dtype: str = "float32",
    batch_size: int | None = None,
) -> ReferenceResult:
    """Static batching: requests in order, `batch_size` at a time (default: all), each batch
    left-padded and run to its longest request before the next starts; only the tokens each
    request asked for (up to its EOS) count."""
    import torch

    model, tokenizer = _load(model_id, dtype)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    size = batch_size or len(cases)
    outputs = []
    started = time.perf_counter()
    for first in range(0, len(cases), size):
        group = cases[first : first + size]
        batch = tokenizer([c.prompt for c in group], return_tensors="pt", padding=True)
        with torch.inference_mode():
            out = model.generate(
                **batch,
                max_new_tokens=max(c.max_new_tokens for c in group),
                do_sample=False,
                eos_token_id=eos_token_ids,
                pad_token_id=tokenizer.pad_token_id,
            )
        for row, case in zip(out[:, batch.input_ids.shape[1] :].tolist(), group, strict=True):
            ids = row[: case.max_new_tokens]
            for i, token in enumerate(ids):
                if token in eos_token_ids:
                    ids = ids[: i + 1]
                    break
            outputs.append(ids)
    wall_s = time.perf_counter() - started
    return ReferenceResult("batched", sum(map(len, outputs)), wall_s, outputs)

"""Deterministic mixed workloads: prompts of varied length with varied output lengths."""

from __future__ import annotations

from dataclasses import dataclass

SENTENCES = [
    "Once upon a time, there was a little girl named Lily.",
    "She loved to play outside in the park with her friends.",
    "One day, a big dog came running across the green grass.",
    "Tom had a red ball and a blue kite that flew very high.",
    "The sun was hot, so they sat under a tall tree to rest.",
    "Mom made a cake and everyone sang a happy song together.",
]


@dataclass(frozen=True)
class Case:
    prompt: str  # text sent as `inputs`
    max_new_tokens: int  # requested output length


def mixed_workload(num_requests: int, min_new: int = 16, max_new: int = 96) -> list[Case]:
    cases = []
    for i in range(num_requests):
        num_sentences = 1 + (i * 5) % 6
        prompt = " ".join(SENTENCES[(i + j) % len(SENTENCES)] for j in range(num_sentences))
        span = max_new - min_new + 1
        cases.append(Case(prompt, min_new + (i * 37) % span))
    return cases

"""The "green list" watermark of Kirchenbauer et al. (2023), as TGI applies it.

Before each draw, the previous token seeds a permutation of the vocabulary; the first
`gamma` share of it is the green list and gets `delta` added to its logits. A detector that
knows the key counts green tokens: watermarked text has far more than `gamma` of them.
"""

from __future__ import annotations

import torch

GAMMA = 0.5  # share of the vocabulary that is green
DELTA = 2.0  # logit bonus of green tokens
HASH_KEY = 15485863  # a large prime, as in the paper's reference code


def green_list(previous_token_id: int, vocab_size: int, device: torch.device) -> torch.Tensor:
    """Ids of the green tokens after `previous_token_id`. [int(GAMMA * vocab_size)]"""
    generator = torch.Generator(device="cpu")
    generator.manual_seed(HASH_KEY * previous_token_id)
    permutation = torch.randperm(vocab_size, generator=generator)
    return permutation[: int(GAMMA * vocab_size)].to(device)


def apply_watermark(logits: torch.Tensor, token_ids: list[int]) -> torch.Tensor:
    """Add DELTA to the green list seeded by the last token. [vocab]"""
    if not token_ids:
        return logits
    logits = logits.clone()
    logits[green_list(token_ids[-1], logits.shape[-1], logits.device)] += DELTA
    return logits


def green_fraction(token_ids: list[int], vocab_size: int) -> float:
    """Detector: the share of tokens (after the first) that are green for their predecessor."""
    pairs = list(zip(token_ids, token_ids[1:], strict=False))
    if not pairs:
        return 0.0
    hits = sum(
        int(token in set(green_list(prev, vocab_size, torch.device("cpu")).tolist()))
        for prev, token in pairs
    )
    return hits / len(pairs)

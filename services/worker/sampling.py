"""Turning logits into tokens: penalties, warpers, greedy or seeded draws.

Replay is exact: a sampled token is drawn from a generator seeded by (seed, token index) only,
so the same request regenerates the same tokens whatever batch it runs in and on whichever
worker group it is replayed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.worker.kernels import CpuKernels
from services.worker.watermark import apply_watermark
from shared.messages import SamplingParams, TopToken

_MASK64 = (1 << 64) - 1


@dataclass
class Sampled:
    token_id: int
    logprob: float
    top_tokens: list[TopToken]


def draw_seed(seed: int, token_index: int) -> int:
    """A 63-bit generator seed from (request seed, 1-based token index) (splitmix64)."""
    z = (seed + token_index * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


def apply_penalties(
    logits: torch.Tensor, params: SamplingParams, token_ids: list[int]
) -> torch.Tensor:
    """Repetition penalty (CTRL), frequency and presence penalties over the tokens seen so
    far, then the logit bias. [vocab]"""
    is_penalized = (
        params.repetition_penalty != 1.0
        or params.frequency_penalty != 0.0
        or params.presence_penalty != 0.0
    )
    if not is_penalized and not params.logit_bias:
        return logits
    logits = logits.clone()
    if is_penalized:
        seen = torch.tensor(token_ids, dtype=torch.long, device=logits.device)
        unique = seen.unique()
        if params.repetition_penalty != 1.0:
            scores = logits[unique]
            penalty = params.repetition_penalty
            logits[unique] = torch.where(scores < 0, scores * penalty, scores / penalty)
        if params.frequency_penalty != 0.0:
            counts = torch.bincount(seen, minlength=logits.shape[-1])[: logits.shape[-1]]
            logits = logits - params.frequency_penalty * counts.to(logits.dtype)
        if params.presence_penalty != 0.0:
            logits[unique] -= params.presence_penalty
    if params.logit_bias:
        vocab = logits.shape[-1]
        biased = [(i, b) for i, b in params.logit_bias.items() if 0 <= i < vocab]
        if biased:
            ids, biases = zip(*biased)
            index = torch.tensor(ids, dtype=torch.long, device=logits.device)
            logits[index] += torch.tensor(biases, dtype=logits.dtype, device=logits.device)
    return logits


def warp(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, top-k, top-p and typical-p; removed tokens get -inf. [vocab]"""
    if params.temperature != 1.0:
        logits = logits / params.temperature
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        remove = cumulative - sorted_logits.softmax(-1) >= params.top_p  # keep >= 1 token
        logits = logits.masked_fill(remove.scatter(0, order, remove), float("-inf"))
    if params.typical_p < 1.0:
        log_probs = logits.log_softmax(-1)
        entropy = -(log_probs.exp().nan_to_num() * log_probs.nan_to_num()).sum()
        deviation = (entropy + log_probs).abs()
        sorted_dev, order = torch.sort(deviation)
        cumulative = log_probs[order].exp().cumsum(-1)
        keep = (cumulative - log_probs[order].exp()) < params.typical_p
        keep[0] = True
        remove = ~keep
        logits = logits.masked_fill(remove.scatter(0, order, remove), float("-inf"))
    return logits


def sample_one(
    logits: torch.Tensor,
    params: SamplingParams,
    token_ids: list[int],
    token_index: int,
    ruled_out: torch.Tensor | None = None,
) -> Sampled:
    """The next token of one request from its logits row. [vocab] float32. `ruled_out`: the
    tokens its grammar forbids (bool [vocab]), masked after the penalties and before the
    warpers, as TGI does; logprobs are then those of the masked distribution."""
    logits = apply_penalties(logits.float(), params, token_ids)
    if params.watermark:
        logits = apply_watermark(logits, token_ids)
    if ruled_out is not None:
        logits = logits.masked_fill(ruled_out, float("-inf"))
    if params.do_sample:
        logits = warp(logits, params)
    log_probs = logits.log_softmax(-1)
    if params.do_sample:
        generator = torch.Generator(device=logits.device)
        generator.manual_seed(draw_seed(params.seed, token_index))
        # exponential race: argmax(p / E), E ~ Exp(1), is a draw from p
        noise = torch.empty_like(log_probs).exponential_(generator=generator)
        token_id = int(torch.argmax(log_probs.exp() / noise))
    else:
        token_id = int(torch.argmax(logits))
    return Sampled(
        token_id, float(log_probs[token_id]), _top_tokens(log_probs, params.top_n_tokens)
    )


def _rows_of(
    logits: torch.Tensor, rows: list[int], ruled_out: dict[int, torch.Tensor]
) -> torch.Tensor:
    """`rows` of `logits`, in order, each row in `ruled_out` with its grammar's forbidden
    tokens masked. The first rows, none masked, are read in place (a copy of a batch-32
    decode's 32 x 49152 floats took ~1 ms on 2 cores); otherwise a copy, masked in place."""
    if not ruled_out and rows[-1] == len(rows) - 1:
        return logits[: len(rows)]
    chosen = logits[rows]
    for n, i in enumerate(rows):
        if i in ruled_out:
            chosen[n].masked_fill_(ruled_out[i], float("-inf"))
    return chosen


def sample_greedy_batch(
    logits: torch.Tensor,
    top_n_tokens: list[int],
    ops: CpuKernels | None = None,
    rows: list[int] | None = None,
    ruled_out: dict[int, torch.Tensor] | None = None,
) -> list[Sampled]:
    """Greedy tokens for rows that need no penalty: one argmax for all, on the CPU kernels
    when given (`ops`: None with --disable-cpu-kernels or off the CPU). [num_rows, vocab];
    `rows`: only those rows (non-empty, ascending), `ruled_out`: row -> the tokens its grammar
    forbids."""
    if rows is not None:
        logits = _rows_of(logits, rows, ruled_out or {})
    if ops is not None and ops.supports(logits.dtype) and logits.is_contiguous():
        token_ids, chosen_logprobs = ops.greedy(logits)  # one read of each row, no float copy
    else:
        logits = logits.float()  # argmax over half precision is several times slower on CPU
        argmax = logits.argmax(-1)
        chosen = logits.log_softmax(-1).gather(1, argmax[:, None])[:, 0]
        token_ids, chosen_logprobs = argmax.tolist(), chosen.tolist()
    return [
        Sampled(
            token_ids[i],
            chosen_logprobs[i],
            _top_tokens(logits[i].float().log_softmax(-1), n) if (n := top_n_tokens[i]) > 0 else [],
        )
        for i in range(len(token_ids))
    ]


def _top_tokens(log_probs: torch.Tensor, n: int) -> list[TopToken]:
    if n <= 0:
        return []
    values, indices = torch.topk(log_probs, n)
    return [
        TopToken(id=int(i), logprob=float(v)) for v, i in zip(values.tolist(), indices.tolist())
    ]


def needs_own_row(params: SamplingParams) -> bool:
    """True when the request cannot take the batched greedy path."""
    return not params.is_plain_greedy

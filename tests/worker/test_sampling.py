"""Sampling units, with no model."""

from __future__ import annotations

import torch

from services.worker.sampling import (
    apply_penalties,
    draw_seed,
    sample_greedy_batch,
    sample_one,
    warp,
)
from services.worker.state import RequestState, stop_reason
from shared.messages import FinishReason, SamplingParams, StoppingParams


def logits(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def test_greedy_takes_the_argmax_with_its_logprob_and_top_tokens():
    (sample,) = sample_greedy_batch(logits(0.1, 2.0, 1.0)[None], [2])
    assert sample.token_id == 1
    assert abs(sample.logprob - float(logits(0.1, 2.0, 1.0).log_softmax(-1)[1])) < 1e-6
    assert [t.id for t in sample.top_tokens] == [1, 2]


def test_seeded_draws_depend_only_on_seed_and_index():
    params = SamplingParams(do_sample=True, seed=42)
    row = torch.randn(50, generator=torch.Generator().manual_seed(0))
    draws = [sample_one(row, params, [1], i).token_id for i in range(1, 20)]
    again = [sample_one(row.clone(), params, [1, 5, 6], i).token_id for i in range(1, 20)]
    assert draws == again
    other = [
        sample_one(row, SamplingParams(do_sample=True, seed=43), [1], i).token_id
        for i in range(1, 20)
    ]
    assert draws != other
    assert draw_seed(1, 2) != draw_seed(2, 1)


def test_seeded_draws_follow_the_distribution():
    probs = torch.tensor([0.7, 0.2, 0.1])
    params = SamplingParams(do_sample=True, seed=7)
    counts = torch.zeros(3)
    for i in range(1, 3001):
        counts[sample_one(probs.log(), params, [], i).token_id] += 1
    assert torch.allclose(counts / 3000, probs, atol=0.03)


def test_top_k_top_p_typical_p_mask_tokens():
    row = logits(4.0, 3.0, 2.0, 1.0, 0.0)
    assert torch.isinf(warp(row, SamplingParams(do_sample=True, top_k=2))[2:]).all()
    kept = ~torch.isinf(warp(row, SamplingParams(do_sample=True, top_p=0.7)))
    assert kept.tolist() == [True, True, False, False, False]
    kept = ~torch.isinf(warp(row, SamplingParams(do_sample=True, typical_p=0.2)))
    assert kept.sum() >= 1 and kept.sum() < 5
    assert torch.allclose(warp(row, SamplingParams(do_sample=True, temperature=2.0)), row / 2)


def test_repetition_and_frequency_penalties():
    row = logits(2.0, -2.0, 1.0)
    out = apply_penalties(row, SamplingParams(repetition_penalty=2.0), [0, 1, 1])
    assert out.tolist() == [1.0, -4.0, 1.0]
    out = apply_penalties(row, SamplingParams(frequency_penalty=0.5), [0, 1, 1])
    assert out.tolist() == [1.5, -3.0, 1.0]
    out = apply_penalties(row, SamplingParams(presence_penalty=0.5), [0, 1, 1])
    assert out.tolist() == [1.5, -2.5, 1.0]  # once per distinct token, however often seen


def test_logit_bias_moves_greedy_and_sampled_picks_and_ignores_ids_past_the_vocab():
    row = logits(2.0, -2.0, 1.0)
    biased = SamplingParams(logit_bias={2: 5.0, 0: -100.0, 99: 3.0})
    assert not biased.is_plain_greedy  # the batched argmax would skip the bias
    assert apply_penalties(row, biased, [0]).tolist() == [-98.0, -2.0, 6.0]
    assert row.tolist() == [2.0, -2.0, 1.0]  # the caller's logits stay as they were
    assert sample_one(row, biased, [0], 1).token_id == 2
    sampled = SamplingParams(do_sample=True, seed=3, logit_bias={1: 100.0})
    assert {sample_one(row, sampled, [0], index).token_id for index in range(1, 20)} == {1}


def test_stop_rules_length_wins_over_eos():
    state = RequestState(
        request_id="r",
        token_ids=[1, 5, 2],
        num_prompt_tokens=1,
        block_ids=[],
        num_computed_tokens=0,
        sampling=SamplingParams(),
        stopping=StoppingParams(max_new_tokens=2),
        reply_to="x",
    )
    assert stop_reason(state, 2, {2}, 512) == FinishReason.LENGTH
    state.stopping = StoppingParams(max_new_tokens=5)
    assert stop_reason(state, 2, {2}, 512) == FinishReason.EOS_TOKEN
    assert stop_reason(state, 5, {2}, 512) is None
    assert stop_reason(state, 5, {2}, 3) == FinishReason.LENGTH
    state.stopping = StoppingParams(max_new_tokens=5, ignore_eos=True, stop_token_ids=[5])
    assert stop_reason(state, 2, {2}, 512) is None
    assert stop_reason(state, 5, {2}, 512) == FinishReason.EOS_TOKEN

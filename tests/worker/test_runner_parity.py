"""The paged engine (scheduler + runner, in process) against transformers' generate."""

from __future__ import annotations

import pytest
import torch

from services.worker.loader import load_model
from tests.support.engine_loop import EngineLoop, make_request
from tests.support.reference import greedy_continuation, reference_model


@pytest.fixture(scope="module")
def loaded_tiny(tiny_llama):
    return load_model(str(tiny_llama))


def prompts(count: int, vocab: int = 300) -> list[list[int]]:
    gen = torch.Generator().manual_seed(123)
    out = []
    for i in range(count):
        length = 3 + (i * 37) % 90
        out.append([1] + torch.randint(3, vocab, (length,), generator=gen).tolist())
    return out


def test_single_request_matches_generate(loaded_tiny, tiny_llama):
    prompt = prompts(1)[0]
    engine = EngineLoop(loaded_tiny, num_blocks=64)
    request = make_request(prompt, max_new_tokens=24)
    engine.add(request)
    engine.run()
    assert engine.tokens[request.request_id] == greedy_continuation(
        reference_model(tiny_llama), prompt, 24, loaded_tiny.eos_token_ids
    )
    assert engine.scheduler.blocks.num_free_blocks == 64


@pytest.mark.parametrize("steps_in_flight", [1, 2])
def test_busy_batch_with_chunked_prefill_matches_generate(loaded_tiny, tiny_llama, steps_in_flight):
    reference = reference_model(tiny_llama)
    engine = EngineLoop(
        loaded_tiny, num_blocks=200, max_batch_prefill_tokens=64, steps_in_flight=steps_in_flight
    )
    requests = [make_request(p, max_new_tokens=8 + (i * 5) % 20) for i, p in enumerate(prompts(12))]
    for request in requests[:6]:
        engine.add(request)
    for _ in range(3):
        engine.step()
    for request in requests[6:]:  # join a running batch
        engine.add(request)
    engine.run()
    for request in requests:
        expected = greedy_continuation(
            reference, request.input_ids, request.stopping.max_new_tokens, loaded_tiny.eos_token_ids
        )
        assert engine.tokens[request.request_id] == expected, request.request_id
    counters = engine.scheduler.counters
    assert counters.num_prefill_chunks > 0
    assert counters.num_joined_running > 0
    assert counters.num_mixed_steps > 0
    assert max(engine.step_sizes) > 1
    assert engine.scheduler.blocks.num_free_blocks == 200


@pytest.mark.parametrize("steps_in_flight", [1, 2])
def test_preemption_recomputes_exactly(loaded_tiny, tiny_llama, steps_in_flight):
    reference = reference_model(tiny_llama)
    # 96 slots: forces preemption
    engine = EngineLoop(loaded_tiny, num_blocks=12, block_size=8, steps_in_flight=steps_in_flight)
    # each fits alone (<= 40 + 30 tokens), two at once do not
    requests = [make_request(p[:40], max_new_tokens=30) for p in prompts(4)]
    for request in requests:
        engine.add(request)
    engine.run()
    assert engine.scheduler.counters.num_preempted > 0
    for request in requests:
        expected = greedy_continuation(reference, request.input_ids, 30, loaded_tiny.eos_token_ids)
        assert engine.tokens[request.request_id] == expected
    assert engine.scheduler.blocks.num_free_blocks == 12


def test_request_larger_than_the_cache_fails_instead_of_waiting(loaded_tiny):
    engine = EngineLoop(loaded_tiny, num_blocks=4, block_size=8)  # 32 slots
    request = make_request(prompts(3)[2], max_new_tokens=10)  # 79-token prompt
    engine.add(request)
    engine.run()
    (ended,) = engine.ended
    assert ended.request_id == request.request_id
    assert "KV cache" in ended.error
    assert engine.scheduler.num_unfinished == 0


def test_prompt_logprobs_match_transformers_across_chunks(loaded_tiny, tiny_llama):
    reference = reference_model(tiny_llama)
    prompt = prompts(3)[2]  # 79 tokens: three chunks under a 32-token budget
    engine = EngineLoop(loaded_tiny, num_blocks=64, max_batch_prefill_tokens=32)
    request = make_request(prompt, max_new_tokens=2, prefill_logprobs=True)
    other = make_request(prompts(2)[1], max_new_tokens=6)  # decodes alongside
    engine.add(other)
    engine.step()
    engine.add(request)
    events = []
    original = engine.runner.execute

    def spy(plan):
        outcome = original(plan)
        events.extend(e for batch in outcome.events.values() for e in batch)
        return outcome

    engine.runner.execute = spy
    engine.run()
    (first,) = [e for e in events if e.request_id == request.request_id and e.index == 1]
    with torch.inference_mode():
        logits = reference(torch.tensor([prompt])).logits[0].log_softmax(-1)
    expected = logits[:-1].gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
    got = torch.tensor(first.prefill_logprobs)
    assert len(got) == len(prompt) and torch.isnan(got[0])
    assert torch.allclose(got[1:], expected, atol=1e-4)
    assert engine.scheduler.counters.num_prefill_chunks >= 2
    later = [e for e in events if e.request_id == request.request_id and e.index > 1]
    assert all(not e.prefill_logprobs for e in later)


def test_top_tokens_match_transformers_top_k(loaded_tiny, tiny_llama):
    reference = reference_model(tiny_llama)
    prompt = prompts(1)[0]
    engine = EngineLoop(loaded_tiny, num_blocks=64)
    request = make_request(prompt, max_new_tokens=1, top_n_tokens=4)
    engine.add(request)
    plan = engine.scheduler.schedule()
    outcome = engine.runner.execute(plan)
    (event,) = outcome.events["test"]
    with torch.inference_mode():
        logprobs = reference(torch.tensor([prompt])).logits[0, -1].log_softmax(-1)
    values, ids = torch.topk(logprobs, 4)
    assert [t.id for t in event.top_tokens[0]] == ids.tolist()
    assert torch.allclose(torch.tensor([t.logprob for t in event.top_tokens[0]]), values, atol=1e-4)


def test_watermark_makes_sampled_text_green(loaded_tiny):
    from services.worker.watermark import GAMMA, green_fraction

    vocab = loaded_tiny.model.config.vocab_size
    fractions = {}
    for watermark in (False, True):
        engine = EngineLoop(loaded_tiny, num_blocks=128)
        requests = [
            make_request(p[:8], max_new_tokens=60, do_sample=True, seed=i, watermark=watermark)
            for i, p in enumerate(prompts(4))
        ]
        for request in requests:
            engine.add(request)
        engine.run()
        fractions[watermark] = sum(
            green_fraction(engine.tokens[r.request_id], vocab) for r in requests
        ) / len(requests)
    assert abs(fractions[False] - GAMMA) < 0.12
    assert fractions[True] > GAMMA + 0.2


def test_prefix_cache_hits_keep_parity(loaded_tiny, tiny_llama):
    reference = reference_model(tiny_llama)
    shared = prompts(3)[2][:70]  # 4 full blocks of 16 are shared
    engine = EngineLoop(loaded_tiny, num_blocks=64)
    first = make_request(shared + [7, 8, 9], max_new_tokens=10)
    engine.add(first)
    engine.run()
    later = [make_request(shared + tail, max_new_tokens=10) for tail in ([5], [11, 12, 13])]
    for request in later:
        engine.add(request)
    engine.run()
    assert engine.scheduler.counters.num_cached_tokens == 2 * 64
    for request in [first, *later]:
        expected = greedy_continuation(reference, request.input_ids, 10, loaded_tiny.eos_token_ids)
        assert engine.tokens[request.request_id] == expected
    assert engine.scheduler.blocks.num_free_blocks == 64


def test_a_plan_short_of_blocks_fails_its_step_and_says_what_it_asked(loaded_tiny, caplog):
    """A plan whose request has too few blocks for its tokens (a scheduler's bug) fails the
    whole step, not the worker: every request in it ends with the error, and the log line
    names what the plan asked of each (blocks held, tokens computed + scheduled)."""
    from shared.messages import NewRequest, StepPlan

    engine = EngineLoop(loaded_tiny, num_blocks=64)
    runner = engine.runner
    request = make_request(prompts(1)[0], max_new_tokens=4)
    new = NewRequest(
        request_id="short",
        input_ids=list(request.input_ids) + [5] * 20,
        sampling=request.sampling,
        stopping=request.stopping,
        reply_to="reply",
        block_ids=[0],  # one block of 16 tokens for more than 16
        num_scheduled_tokens=len(request.input_ids) + 20,
    )
    with caplog.at_level("ERROR", logger="services.worker.runner"):
        outcome = runner.execute(StepPlan(step_id=1, reset=True, new_requests=[new]))
    assert outcome.result.error.startswith("IndexError")
    assert [o.request_id for o in outcome.result.outputs] == ["short"]
    assert f"short: 1 blocks, 0+{new.num_scheduled_tokens}" in caplog.text
    assert "short" not in runner.requests

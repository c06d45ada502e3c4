"""--speculate: n-gram proposals verified greedily in one forward pass. Output is exactly the
output without speculation (and transformers'), alone and batched, in fewer forward passes on
repetitive text; the scheduler reserves KV blocks for the proposals."""

from __future__ import annotations

import time

import pytest

from services.engine import Engine
from services.scheduler.config import SchedulerConfig
from services.scheduler.scheduler import Scheduler
from services.worker.speculation import accepted, propose
from shared.messages import FinishReason, GenerateRequest, SamplingParams, StoppingParams
from tests.support.reference import greedy_continuation, reference_model

REPETITIVE = (
    "Once upon a time, there was a little girl named Lily. She liked to play in the park. "
    "Once upon a time, there was a little girl named Lily. She liked to play"
)
PROMPTS = [REPETITIVE, "The cat sat on the mat. The cat sat on the mat. The cat", "Tom had a"]


def test_propose_takes_the_latest_longest_match():
    assert propose([1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3], 3) == [7, 5, 1]  # latest "1 2 3"
    assert propose([4, 5, 6, 5], 2) == [6, 5]  # only "5" matches
    assert propose([1, 2, 3], 4) == []  # nothing repeats
    assert propose([7, 7], 3) == [7]  # as much as follows
    assert propose([1, 2, 1], 0) == []


def test_accepted_stops_at_the_first_wrong_draft():
    # verified[j]: the greedy token after the real token and drafts[:j]
    assert accepted([5, 6, 7], [5, 6, 8, 9]) == [5, 6, 8]  # 7 was wrong; 8 replaces it
    assert accepted([5, 6], [5, 6, 9]) == [5, 6, 9]  # all right, plus the token after them
    assert accepted([5], [4, 1]) == [4]  # the first draft wrong: just the greedy token
    assert accepted([], [3]) == [3]


@pytest.fixture(scope="module")
def expected(stories_model):
    engine = Engine(str(stories_model), num_blocks=256)
    ids = [engine.tokenizer.encode(p).ids for p in PROMPTS]
    reference = reference_model(stories_model)
    return ids, [greedy_continuation(reference, i, 60, []) for i in ids]


def test_same_tokens_as_transformers_alone_and_batched(stories_model, expected):
    ids, tokens = expected
    alone = []
    for prompt_ids in ids:
        engine = Engine(str(stories_model), num_blocks=256, speculate=3)
        alone.append(engine.generate([prompt_ids], max_new_tokens=60)[0].token_ids)
    assert alone == tokens
    engine = Engine(str(stories_model), num_blocks=256, speculate=3)
    assert [o.token_ids for o in engine.generate(ids, max_new_tokens=60)] == tokens
    assert engine.stats.num_accepted_tokens > 0
    assert engine.scheduler.blocks.num_free_blocks == 256  # every reserved block came back


def test_fewer_forward_passes_on_a_repetitive_prompt(stories_model, expected):
    ids, tokens = expected
    plain = Engine(str(stories_model), num_blocks=256)
    speculative = Engine(str(stories_model), num_blocks=256, speculate=3)
    for engine in (plain, speculative):  # the cat prompt: the model goes on repeating itself
        assert engine.generate([ids[1]], max_new_tokens=60)[0].token_ids == tokens[1]
    # one prefill, 59 decodes (and one overlapped plan for a request already done)
    assert plain.stats.num_steps in (60, 61)
    assert speculative.stats.num_steps < 0.75 * plain.stats.num_steps, speculative.stats
    assert speculative.stats.num_draft_tokens >= speculative.stats.num_accepted_tokens > 15


def test_max_new_tokens_and_stop_tokens_are_exact(stories_model, expected):
    ids, tokens = expected
    engine = Engine(str(stories_model), num_blocks=256, speculate=4)
    for limit in (1, 2, 7, 13):  # proposals never run past max_new_tokens
        assert engine.generate([ids[0]], max_new_tokens=limit)[0].token_ids == tokens[0][:limit]
    # a stop token that arrives inside a run of accepted proposals ends the request there
    for stop_token in set(tokens[0][5:40]):
        first = tokens[0].index(stop_token)
        assert _generate_with_stop(stories_model, ids[0], stop_token) == tokens[0][: first + 1]


def _generate_with_stop(folder, prompt_ids, stop_token):
    engine = Engine(str(folder), num_blocks=256, speculate=4)
    request_id = engine.add(prompt_ids, 60, stop_token_ids=[stop_token])
    engine.run()
    output = engine.take(request_id)
    assert output.finish_reason == FinishReason.EOS_TOKEN
    return output.token_ids


def test_scheduler_reserves_blocks_for_proposals_of_greedy_decodes_only():
    def admitted(params: SamplingParams, speculate: int) -> Scheduler:
        scheduler = Scheduler(
            SchedulerConfig(num_blocks=64, block_size=4, num_speculative_tokens=speculate),
            clock=time.time,
        )
        scheduler.add(
            GenerateRequest(
                request_id="r",
                input_ids=[1, 2, 3, 4, 5, 6, 7],
                sampling=params,
                stopping=StoppingParams(max_new_tokens=50),
                reply_to="",
                created_at=time.time(),
                deadline=0.0,
            ),
            b"0-0",
        )
        scheduler.schedule()  # the prompt: 7 tokens, 2 blocks
        scheduler.schedule()  # a decode planned before the prompt's answer
        return scheduler

    greedy = admitted(SamplingParams(), 3)
    # 8 tokens computed after the second plan, + 3 proposals for each of 2 steps in flight
    assert len(greedy.requests["r"].block_ids) == -(-(8 + 3 * 2) // 4)
    assert len(admitted(SamplingParams(), 0).requests["r"].block_ids) == 2
    sampled = admitted(SamplingParams(do_sample=True, seed=1), 3)
    assert len(sampled.requests["r"].block_ids) == 2  # no proposals for sampled requests

"""Automatic prefix caching: full blocks are shared by hash from the plan that computes them,
reference counted, and evicted least-recently-freed first; a failed step's blocks leave the
cache."""

from __future__ import annotations

from services.scheduler.block_manager import BlockManager, block_hashes
from shared.messages import StepResult
from tests.scheduler.factories import answer, request, scheduler

SHARED = list(range(500, 512))  # 12 tokens: three blocks of 4


def run_to_end(s, finish_ids):
    while (plan := s.schedule()) is not None:
        answer(s, plan, finish=set(finish_ids))


def test_a_shared_prefix_is_computed_once_and_its_blocks_shared():
    s = scheduler(block_size=4)
    first = request(14, prefix=SHARED)
    s.add(first, b"1-0")
    plan = s.schedule()
    assert plan.new_requests[0].num_computed_tokens == 0
    answer(s, plan)  # 14 prompt tokens computed: blocks 0-2 are full and cached
    second = request(15, prefix=SHARED)
    s.add(second, b"2-0")
    plan = s.schedule()
    (new,) = plan.new_requests
    assert new.num_computed_tokens == 12 and new.num_scheduled_tokens == 3
    first_blocks = s.requests[first.request_id].block_ids
    assert new.block_ids[:3] == first_blocks[:3]
    assert s.counters.num_cached_tokens == 12
    answer(s, plan, finish={first.request_id, second.request_id})
    assert s.blocks.num_free_blocks == s.blocks.num_blocks  # shared blocks freed once each


def test_at_least_one_token_is_computed_even_on_a_full_hit():
    s = scheduler(block_size=4)
    first = request(12, prefix=SHARED)
    s.add(first, b"1-0")
    answer(s, s.schedule(), finish={first.request_id})
    again = request(12, prefix=SHARED)  # the very same 12 tokens
    s.add(again, b"2-0")
    (new,) = s.schedule().new_requests
    assert new.num_computed_tokens == 8 and new.num_scheduled_tokens == 4


def test_cached_blocks_are_evicted_least_recently_freed_first():
    blocks = BlockManager(num_blocks=3, block_size=2)
    a, b = blocks.allocate(1), blocks.allocate(1)
    blocks.register(a[0], 111)
    blocks.register(b[0], 222)
    blocks.free(a)
    blocks.free(b)
    assert blocks.num_free_blocks == 3 and blocks.num_cached_blocks == 2
    blocks.allocate(2)  # the never-cached block first, then the oldest cached one (a)
    assert blocks.cached_prefix([111]) == []
    assert blocks.cached_prefix([222]) == b


def test_hashes_chain_the_whole_prefix():
    assert block_hashes([1, 2, 3, 4], 2, 2)[1] != block_hashes([9, 9, 3, 4], 2, 2)[1]
    assert block_hashes([1, 2, 3, 4], 2, 2) == block_hashes([1, 2, 3, 4, 5], 2, 2)


def test_disabled_caching_and_prompt_logprobs_recompute_everything():
    for s, make in (
        (scheduler(block_size=4, prefix_caching=False), lambda: request(14, prefix=SHARED)),
        (scheduler(block_size=4), lambda: request(14, prefix=SHARED, prefill_logprobs=True)),
    ):
        first = make()
        s.add(first, b"1-0")
        answer(s, s.schedule(), finish={first.request_id})
        second = make()
        s.add(second, b"2-0")
        assert s.schedule().new_requests[0].num_computed_tokens == 0


def test_blocks_are_shared_from_the_plan_that_computes_them():
    """Requests with one long prefix that arrive together compute it once: the second takes
    the first's blocks in the next plan, before the first plan is answered (the worker runs
    plans in order)."""
    s = scheduler(block_size=4, prefill=16)
    shared = list(range(700, 716))  # four blocks
    first, second = request(18, prefix=shared), request(19, prefix=shared)
    s.add(first, b"1-0")
    s.add(second, b"2-0")
    plan = s.schedule()  # the budget holds the first's 16 shared tokens, nothing of the second
    assert [n.request_id for n in plan.new_requests] == [first.request_id]
    plan2 = s.schedule()  # planned with the first one still in flight
    (new,) = [n for n in plan2.new_requests if n.request_id == second.request_id]
    assert new.num_computed_tokens == 16 and new.num_scheduled_tokens == 3
    assert new.block_ids[:4] == s.requests[first.request_id].block_ids[:4]
    assert s.counters.num_cached_tokens == 16
    answer(s, plan)
    answer(s, plan2, finish={first.request_id, second.request_id})
    while (plan := s.schedule()) is not None:
        answer(s, plan, finish={first.request_id, second.request_id})
    assert s.blocks.num_free_blocks == s.blocks.num_blocks


def test_a_failed_steps_blocks_leave_the_cache_and_fail_who_took_them():
    s = scheduler(block_size=4, prefill=16)
    shared = list(range(800, 816))
    first, second = request(18, prefix=shared), request(19, prefix=shared)
    s.add(first, b"1-0")
    s.add(second, b"2-0")
    plan = s.schedule()
    s.schedule()  # the second took the first's planned blocks
    assert s.blocks.num_cached_blocks == 4
    s.update(StepResult(step_id=plan.step_id, outputs=[], error="worker out of memory"))
    assert s.blocks.num_cached_blocks == 0
    ended = {r.request_id: r for r in s.take_ended()}
    assert set(ended) == {first.request_id, second.request_id}
    assert "cached prompt prefix failed: worker out of memory" in ended[second.request_id].error
    third = request(18, prefix=shared)  # computes the prefix afresh
    s.add(third, b"3-0")
    (new,) = s.schedule().new_requests
    assert new.num_computed_tokens == 0

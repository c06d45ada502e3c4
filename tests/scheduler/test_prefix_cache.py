"""Automatic prefix caching: full computed blocks are shared by hash, reference counted, and
evicted least-recently-freed first."""

from __future__ import annotations

from services.scheduler.block_manager import BlockManager, block_hashes
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

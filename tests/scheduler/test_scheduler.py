"""The scheduler's decisions, with fabricated worker results (no model, no Redis)."""

from __future__ import annotations

import pytest

from services.scheduler.block_manager import BlockManager
from services.scheduler.request import RequestStatus
from shared.messages import RequestOutput, StepResult
from tests.scheduler.factories import answer, request, scheduled, scheduler


def test_block_manager_allocates_and_frees_each_block_once():
    blocks = BlockManager(num_blocks=4, block_size=16)
    a = blocks.allocate(3)
    assert len(set(a)) == 3 and blocks.num_free_blocks == 1
    assert blocks.num_missing_blocks(33, 2) == 1 and blocks.num_missing_blocks(32, 2) == 0
    blocks.free(a)
    assert blocks.num_free_blocks == 4
    try:
        blocks.free([a[0]])
    except ValueError:
        pass
    else:
        raise AssertionError("double free was accepted")


def test_first_plan_resets_the_worker_and_later_ones_do_not():
    s = scheduler()
    s.add(request(5), b"1-0")
    first = s.schedule()
    assert first.reset and first.new_requests[0].num_scheduled_tokens == 5
    answer(s, first)
    second = s.schedule()
    assert not second.reset and scheduled(second) == {first.new_requests[0].request_id: 1}


def test_long_prompt_is_chunked_under_the_budget_while_others_decode():
    s = scheduler(prefill=16)
    short = request(4)
    s.add(short, b"1-0")
    answer(s, s.schedule())  # short now decodes
    long = request(40)
    s.add(long, b"2-0")
    chunks = []
    while s.requests[long.request_id].num_computed_tokens < 40:
        plan = s.schedule()
        sizes = scheduled(plan)
        assert sum(sizes.values()) <= 16
        assert sizes[short.request_id] == 1  # decode continues in every step
        chunks.append(sizes[long.request_id])
        answer(s, plan)
    assert chunks == [15, 15, 10]
    assert s.counters.num_prefill_chunks == 2
    assert s.counters.num_mixed_steps == 3
    assert s.counters.num_joined_running == 1


@pytest.mark.parametrize("prompt, chunks", [(64, [64]), (67, [67]), (68, [63, 5])])
def test_a_prompt_overruns_the_budget_by_a_sixteenth_to_finish(prompt, chunks):
    """With 64 tokens a step and one decode beside it, a prompt whose rest past the budget is at
    most 4 tokens (64 // 16) finishes in one step; a longer rest waits for the next."""
    s = scheduler(prefill=64)
    short = request(4)
    s.add(short, b"1-0")
    answer(s, s.schedule())  # short now decodes
    long = request(prompt)
    s.add(long, b"2-0")
    sizes = []
    while s.requests[long.request_id].num_computed_tokens < prompt:
        plan = s.schedule()
        sizes.append(scheduled(plan)[long.request_id])
        answer(s, plan)
    assert sizes == chunks
    assert s.counters.num_prompt_tails == (len(chunks) == 1 and prompt > 63)


def test_blocks_are_allocated_as_tokens_grow_and_all_freed_at_the_end():
    s = scheduler(num_blocks=8, block_size=4)
    r = request(6, max_new_tokens=5)
    s.add(r, b"1-0")
    plan = s.schedule()
    assert len(plan.new_requests[0].block_ids) == 2
    answer(s, plan)  # 7 known tokens, 6 computed
    for _ in range(2):  # tokens 7 and 8 still fit block 2
        plan = s.schedule()
        assert plan.running[0].new_block_ids == []
        answer(s, plan)
    plan = s.schedule()
    assert len(plan.running[0].new_block_ids) == 1  # token 9 opens block 3
    answer(s, plan, finish={r.request_id})
    ended = s.take_ended()
    assert [e.request_id for e in ended] == [r.request_id]
    assert ended[0].status == RequestStatus.FINISHED
    assert s.blocks.num_free_blocks == 8 and not s.running


def test_admission_keeps_priority_then_arrival_order_and_batch_size():
    s = scheduler(max_batch_size=2)
    low, high, mid = request(3, priority=0), request(3, priority=5), request(3, priority=1)
    for i, r in enumerate((low, high, mid)):
        s.add(r, f"{i}-0".encode())
    plan = s.schedule()
    assert [n.request_id for n in plan.new_requests] == [high.request_id, mid.request_id]
    assert [w.request_id for w in s.waiting] == [low.request_id]


def test_out_of_blocks_preempts_the_newest_and_resends_it_with_its_tokens():
    s = scheduler(num_blocks=4, block_size=4)
    old, new = request(7), request(7)
    s.add(old, b"1-0")
    s.add(new, b"2-0")
    answer(s, s.schedule())  # both hold 2 blocks, 8 known tokens each
    answer(s, s.schedule())  # both 8 computed, 9 known: each needs a third block
    plan = s.schedule()
    assert new.request_id in plan.released_ids
    assert scheduled(plan) == {old.request_id: 1}
    assert s.counters.num_preempted == 1
    answer(s, plan, finish={old.request_id})
    plan = s.schedule()
    (resent,) = plan.new_requests
    assert resent.request_id == new.request_id
    assert resent.generated_ids == [7, 7] and resent.num_scheduled_tokens == 9


def test_abort_frees_blocks_and_tells_the_worker():
    s = scheduler()
    r = request(10)
    s.add(r, b"1-0")
    answer(s, s.schedule())
    assert s.abort(r.request_id) and not s.abort("unknown")
    plan = s.schedule()
    assert plan.released_ids == [r.request_id] and not plan.running
    assert s.blocks.num_free_blocks == s.blocks.num_blocks
    assert s.take_ended()[0].status == RequestStatus.ABORTED


def test_expired_requests_end_without_running():
    now = [100.0]
    s = scheduler(clock=lambda: now[0])
    r = request(3, deadline=150.0)
    s.add(r, b"1-0")
    now[0] = 151.0
    s.expire()
    assert s.schedule() is None
    assert s.take_ended()[0].status == RequestStatus.EXPIRED


def test_worker_error_fails_every_request_of_the_step():
    s = scheduler()
    a, b = request(3), request(3)
    s.add(a, b"1-0")
    s.add(b, b"2-0")
    plan = s.schedule()
    s.update(StepResult(step_id=plan.step_id, error="boom"))
    assert {e.status for e in s.take_ended()} == {RequestStatus.FAILED}
    assert s.num_unfinished == 0 and s.blocks.num_free_blocks == s.blocks.num_blocks


def test_a_later_attempt_replaces_the_held_request_once_its_step_is_back():
    """The gateway re-submitted a request (attempt 1, with the tokens it delivered) while this
    scheduler runs attempt 0: attempt 0 ends (its blocks freed, the worker told), attempt 1
    waits until the step in flight that names the id is answered, then runs from its tokens.
    Copies of the same or an earlier attempt are refused (the caller acknowledges them)."""
    import msgspec

    s = scheduler(num_blocks=8, block_size=4)
    first = request(6, max_new_tokens=10)
    assert s.add(first, b"1-0")
    answer(s, s.schedule())  # the prompt, and a first token
    in_flight = s.schedule()  # a decode step the worker has not answered yet
    resumed = msgspec.structs.replace(first, generated_ids=[7, 8], attempt=1)
    assert s.add(resumed, b"2-0")
    assert first.request_id not in s.requests  # attempt 0 ended, attempt 1 waits for the step
    (ended,) = s.take_ended()
    assert ended.status == RequestStatus.ABORTED and ended.entry_id == b"1-0"
    assert not s.add(resumed, b"3-0") and not s.add(first, b"4-0")  # stale or equal copies
    assert s.add(resumed, b"2-0")  # the waiting attempt's entry again: nothing to acknowledge
    assert s.stats("g").num_waiting == 1  # counted while it waits (`textgen queue`)
    assert s.held_entries() == [("", b"2-0")]  # kept fresh, so no other scheduler claims it
    stale = RequestOutput(request_id=first.request_id, token_ids=[99])
    s.update(StepResult(step_id=in_flight.step_id, outputs=[stale]))  # attempt 0's token
    held = s.requests[first.request_id]
    assert held.entry_id == b"2-0" and held.token_ids[held.num_prompt_tokens :] == [7, 8]
    plan = s.schedule()
    assert plan.released_ids == [first.request_id]  # the worker drops attempt 0 first
    assert [r.request_id for r in plan.new_requests] == [first.request_id]
    assert not s.add(first, b"5-0") and s.add(resumed, b"2-0")  # a copy; the held entry again


def test_a_stop_hands_back_a_later_attempt_that_waits():
    """A scheduler that stops while a later attempt waits for a step in flight requeues it with
    the rest, rather than leaving its entry for another scheduler to claim much later."""
    import msgspec

    s = scheduler(num_blocks=8, block_size=4)
    first = request(6, max_new_tokens=10)
    s.add(first, b"1-0")
    s.schedule()  # in flight
    assert s.add(msgspec.structs.replace(first, attempt=1), b"2-0")
    s.take_ended()
    s.withdraw(only_waiting=True)
    (handed_back,) = s.take_ended()
    assert handed_back.status == RequestStatus.HANDED_BACK and handed_back.entry_id == b"2-0"
    assert s.held_entries() == [] and s.stats("g").num_waiting == 0


def test_an_abort_below_an_attempt_spares_that_attempt():
    """The gateway re-submitted a request as attempt 2 and aborts the attempts below it: a
    scheduler holding attempt 1 drops it, one holding attempt 2 keeps it; an abort of every
    attempt drops any."""
    import msgspec

    from services.scheduler.aborts import AbortListener
    from shared.codec import encode
    from shared.messages import AbortRequest

    listener = AbortListener(redis=None, channels=None, memory_s=60)  # type: ignore[arg-type]
    listener.hear(encode(AbortRequest(request_id="x", reason="resumed", below_attempt=2)))
    assert listener.covers("x", 1) and not listener.covers("x", 2)
    listener.hear(encode(AbortRequest(request_id="x", reason="resumed", below_attempt=1)))
    assert listener.covers("x", 1)  # the wider abort heard first still holds
    listener.hear(encode(AbortRequest(request_id="x", reason="disconnect")))
    assert listener.covers("x", 5) and listener.recent() == [("x", 0)]
    s = scheduler()
    old = msgspec.structs.replace(request(4), attempt=1)
    new = msgspec.structs.replace(old, attempt=2)
    s.add(new, b"1-0")
    assert not s.abort(new.request_id, below_attempt=2) and new.request_id in s.requests
    other = scheduler()
    other.add(old, b"2-0")
    assert other.abort(old.request_id, below_attempt=2) and old.request_id not in other.requests
    assert s.abort(new.request_id) and new.request_id not in s.requests

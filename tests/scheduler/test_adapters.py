"""LoRA adapters in the scheduler: no more distinct adapters run at once than the worker
holds (later requests that fit go first, as in vLLM), and prefix-cache keys include the
adapter; a request the worker refused before computing it leaves no cached blocks."""

from __future__ import annotations

from shared.messages import RequestOutput, StepResult
from tests.scheduler.factories import answer, request, scheduled, scheduler

SHARED = list(range(500, 512))  # three blocks of 4


def test_distinct_adapters_running_are_capped_at_the_worker_slots():
    s = scheduler(max_loras=2)
    requests = [request(4, adapter=a) for a in ("x", "y", "z", "x", "")]
    for number, r in enumerate(requests):
        s.add(r, f"{number}-0".encode())
    plan = s.schedule()
    # z would be a third adapter: it waits; x again, and the base model, go ahead of it
    assert set(scheduled(plan)) == {requests[i].request_id for i in (0, 1, 3, 4)}
    assert [w.request_id for w in s.waiting] == [requests[2].request_id]
    answer(s, plan, finish={requests[1].request_id})  # y's only request ends
    plan = s.schedule()
    assert requests[2].request_id in scheduled(plan)  # z takes y's slot


def test_no_cap_without_adapter_slots():
    s = scheduler()
    for number, adapter in enumerate("abcdef"):
        s.add(request(4, adapter=adapter), f"{number}-0".encode())
    assert len(scheduled(s.schedule())) == 6


def test_prefix_cache_keys_include_the_adapter():
    s = scheduler(block_size=4)
    first = request(14, prefix=SHARED, adapter="x")
    s.add(first, b"1-0")
    answer(s, s.schedule())
    for number, adapter in enumerate(("y", "", "x")):
        other = request(14, prefix=SHARED, adapter=adapter)
        s.add(other, f"{number + 2}-0".encode())
        (new,) = s.schedule().new_requests
        # the same prompt under another adapter (or none) has other keys and values
        assert new.num_computed_tokens == (12 if adapter == "x" else 0), adapter
        s.abort(other.request_id)


def test_a_refused_request_leaves_no_cached_blocks():
    """The worker refused it before the forward pass (its adapter could not load): the blocks
    its plan registered hold nothing, so they leave the cache."""
    s = scheduler(block_size=4)
    refused = request(14, prefix=SHARED, adapter="x")
    s.add(refused, b"1-0")
    plan = s.schedule()
    output = RequestOutput(request_id=refused.request_id, error="cannot load", refused=True)
    s.update(StepResult(step_id=plan.step_id, outputs=[output]))
    assert s.blocks.num_cached_blocks == 0
    again = request(14, prefix=SHARED, adapter="x")
    s.add(again, b"2-0")
    (new,) = s.schedule().new_requests
    assert new.num_computed_tokens == 0

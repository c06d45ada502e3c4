import asyncio

from services.gateway.pipeline.replies import RESUME, ReplyRouter, without_duplicates
from shared.messages import FinishReason, ReplyBatch, TokenEvent


def event(index: int, ids: list[int], **kwargs) -> TokenEvent:
    return TokenEvent(
        request_id="r", index=index, token_ids=ids, logprobs=[-float(i) for i in ids], **kwargs
    )


def test_without_duplicates():
    assert without_duplicates(event(3, [7, 8]), 2) == event(3, [7, 8])
    assert without_duplicates(event(1, [5, 6]), 2) is None
    trimmed = without_duplicates(event(2, [6, 7, 8]), 3)
    assert (trimmed.index, trimmed.token_ids, trimmed.logprobs) == (4, [8], [-8.0])
    final = without_duplicates(event(1, [5], finish_reason=FinishReason.LENGTH), 3)
    assert final.token_ids == [] and final.finish_reason == FinishReason.LENGTH


async def test_router_demux_drops_unknown_and_replayed():
    router = ReplyRouter(client=None, channel="c")
    queue = router.register("r")
    other = router.register("o")
    router.dispatch(
        ReplyBatch(
            events=[
                event(1, [5]),
                event(2, [6]),
                TokenEvent(request_id="ghost", index=1, token_ids=[1]),
            ]
        )
    )
    # the request was replayed on another worker group: its first tokens come again
    router.dispatch(ReplyBatch(events=[event(1, [5, 6, 7])]))
    received = [queue.get_nowait() for _ in range(queue.qsize())]
    assert [(e.index, e.token_ids) for e in received] == [(1, [5]), (2, [6]), (3, [7])]
    assert other.empty()
    router.unregister("r")
    router.dispatch(ReplyBatch(events=[event(4, [9])]))
    assert queue.qsize() == 0
    await asyncio.sleep(0)


def test_poisoned_batches_are_skipped(caplog):
    import msgspec

    from shared.codec import encode
    from shared.messages import SCHEMA_VERSION

    router = ReplyRouter(client=None, channel="c")
    queue = router.register("r")
    poison = [
        b"",
        b"\xff\x00garbage",
        b"\x81\xa6events\xa5oops",  # {"events": "oops"}
        msgspec.msgpack.encode({"events": [{"request_id": 5}]}),
        msgspec.msgpack.encode({"events": [{"request_id": "r", "token_ids": ["a"]}]}),
        msgspec.msgpack.encode([1, 2, 3]),
        encode(ReplyBatch(v=SCHEMA_VERSION + 1, events=[event(1, [5])])),
    ]
    for data in poison:
        router.on_message(data)  # never raises
    assert queue.empty()
    assert len([r for r in caplog.records if "dropping" in r.getMessage()]) == len(poison)
    router.on_message(encode(ReplyBatch(events=[event(1, [5])])))
    assert queue.get_nowait().token_ids == [5]


class _LostPubSub:
    """A pub/sub whose connection drops on the first read, then stays refused."""

    def __init__(self, calls: list[str]):
        self.calls = calls

    async def subscribe(self, channel):
        from redis.exceptions import ConnectionError as RedisConnectionError

        self.calls.append("subscribe")
        if self.calls.count("subscribe") > 1:
            raise RedisConnectionError("refused")

    async def get_message(self, **_):
        from redis.exceptions import ConnectionError as RedisConnectionError

        await asyncio.sleep(0.01)
        raise RedisConnectionError("Connection closed by server.")

    async def aclose(self):
        pass


class _Client:
    def __init__(self):
        self.calls: list[str] = []

    def pubsub(self):
        return _LostPubSub(self.calls)


async def test_lost_subscription_fails_requests_in_flight_with_resuming_off():
    client = _Client()
    router = ReplyRouter(client=client, channel="c", resume=False)
    queues = [router.register(f"r{i}") for i in range(3)]
    await router.start()
    try:
        for i, queue in enumerate(queues):
            lost = await asyncio.wait_for(queue.get(), 1.0)
            assert lost.request_id == f"r{i}" and lost.error_type == "generation"
            assert "lost the connection to Redis" in lost.error
        await asyncio.sleep(0.4)  # retries with backoff, and keeps running
        assert client.calls.count("subscribe") >= 2
        assert not router.is_subscribed and not router._task.done()
    finally:
        await router.stop()


async def test_lost_subscription_tells_requests_in_flight_to_resume_once():
    client = _Client()
    router = ReplyRouter(client=client, channel="c")
    queues = [router.register(f"r{i}") for i in range(3)]
    await router.start()
    try:
        for i, queue in enumerate(queues):
            told = await asyncio.wait_for(queue.get(), 1.0)
            assert told.request_id == f"r{i}" and told.error_type == RESUME
        await asyncio.sleep(0.4)  # lost again on every retry: still one RESUME until resumed
        assert all(queue.empty() for queue in queues)
        router.resumed("r0", 1)
        router.lose_all()
        assert queues[0].get_nowait().error_type == RESUME
        assert queues[1].empty() and router.num_resumes == 4
    finally:
        await router.stop()


def test_only_contiguous_indexes_are_delivered():
    """Tokens 1-2, then 4-5 (3 was published while nobody listened): 4-5 are dropped and the
    request is told to resume; its resumed copy's 3-5 then go through, and 4-5 of the old copy
    once more are duplicates."""
    replaced = []
    router = ReplyRouter(
        client=None, channel="c", on_replaced_attempt_event=lambda: replaced.append(1)
    )
    queue = router.register("r")
    router.dispatch(ReplyBatch(events=[event(1, [5, 6])]))
    router.dispatch(ReplyBatch(events=[event(4, [8, 9])]))
    router.dispatch(ReplyBatch(events=[event(6, [10])]))  # still past the gap: one RESUME
    received = [queue.get_nowait() for _ in range(queue.qsize())]
    assert [(e.index, e.token_ids, e.error_type) for e in received] == [
        (1, [5, 6], ""),
        (0, [], RESUME),
    ]
    router.resumed("r", 1)
    # the old copy's late tokens past the gap are no loss once it was replaced: no RESUME
    router.dispatch(ReplyBatch(events=[event(5, [9])]))
    router.dispatch(ReplyBatch(events=[event(3, [7, 8, 9], attempt=1)]))
    router.dispatch(ReplyBatch(events=[event(4, [8, 9])]))
    received = [queue.get_nowait() for _ in range(queue.qsize())]
    assert [(e.index, e.token_ids) for e in received] == [(3, [7, 8, 9])]
    assert router.num_resumes == 1 and len(replaced) == 1

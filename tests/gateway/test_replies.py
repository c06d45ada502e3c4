import asyncio

from services.gateway.replies import ReplyRouter, without_duplicates
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

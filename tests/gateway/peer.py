"""A stand-in worker for gateway tests, over real Redis: it reads GenerateRequests from the
request stream and PUBLISHes ReplyBatches of TokenEvents to each request's reply_to.

What it answers depends on the prompt: "FAIL" -> an error event, "SILENT" -> nothing,
"SLOW" -> 0.2 s between tokens; otherwise the tokens of CONTINUATION (up to max_new_tokens),
then EOS.
"""

from __future__ import annotations

import asyncio
from typing import Self

import redis.asyncio as aioredis

from services.gateway.pipeline.tokenizer import TextTokenizer
from shared.bus import read_stream
from shared.channels import Channels
from shared.codec import encode
from shared.messages import FinishReason, GenerateRequest, ReplyBatch, TokenEvent, TopToken

CONTINUATION = " the cat sat on the mat. 日本 the dog ran"
EOS = 2
LOGPROB = -0.5


class WorkerPeer:
    def __init__(self, redis_url: str, namespace: str, tokenizer: TextTokenizer):
        self.client = aioredis.from_url(redis_url)
        self.channels = Channels(namespace)
        self.tokenizer = tokenizer
        self.requests: list[GenerateRequest] = []
        self.continuation_ids = tokenizer.encode(CONTINUATION)[1:]
        self._task: asyncio.Task | None = None
        self._replies: set[asyncio.Task] = set()
        # stop by flag, not by cancelling: a cancelled blocking XREAD can hang redis-py
        self._is_stopping = False

    async def __aenter__(self) -> Self:
        self._task = asyncio.create_task(self._serve())
        return self

    async def __aexit__(self, *exc) -> None:
        self._is_stopping = True
        await asyncio.wait([self._task, *self._replies], timeout=5)
        await self.client.aclose()

    async def _serve(self) -> None:
        last_id = b"0-0"
        while not self._is_stopping:
            entries = await read_stream(
                self.client, self.channels.requests, last_id, GenerateRequest, block_ms=100
            )
            for entry_id, request in entries:
                last_id = entry_id
                self.requests.append(request)
                task = asyncio.create_task(self._answer(request))
                self._replies.add(task)

    async def _publish(self, request: GenerateRequest, event: TokenEvent) -> None:
        await self.client.publish(request.reply_to, encode(ReplyBatch(events=[event])))

    async def _answer(self, request: GenerateRequest) -> None:
        prompt = self.tokenizer.decode(request.input_ids)
        if "SILENT" in prompt:
            return
        if "FAIL" in prompt:
            event = TokenEvent(
                request_id=request.request_id,
                error="worker exploded",
                scheduled_at=request.created_at,
            )
            await self._publish(request, event)
            return
        ids = [*self.continuation_ids, EOS][: request.stopping.max_new_tokens]
        for position, token_id in enumerate(ids):
            is_last = position == len(ids) - 1
            reason = None
            if is_last:
                reason = FinishReason.EOS_TOKEN if token_id == EOS else FinishReason.LENGTH
            top_n = request.sampling.top_n_tokens
            event = TokenEvent(
                request_id=request.request_id,
                index=position + 1,
                token_ids=[token_id],
                logprobs=[LOGPROB],
                top_tokens=[[TopToken(id=token_id + k, logprob=LOGPROB - k) for k in range(top_n)]]
                if top_n
                else [],
                finish_reason=reason,
                scheduled_at=request.created_at + 0.001 if position == 0 else 0.0,
            )
            if self._is_stopping:
                return
            await self._publish(request, event)
            if "SLOW" in prompt:
                await asyncio.sleep(0.2)

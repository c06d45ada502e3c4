"""The SSE bodies of streamed OpenAI answers, chat and completions.

Each choice streams through its own StopHoldback (no delta ever shows a stop string); the
choices of one request interleave as their tokens come. Chat opens every choice with a
`{"role": "assistant", "content": ""}` delta, in index order, so the OpenAI SDK's accumulator
builds one message per choice; later deltas carry only new content. A choice's last chunk
has its finish_reason; the usage chunk (if asked) follows the last choice's; `data: [DONE]`
ends every stream, also after an in-stream error (OpenAI's error object).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from services.gateway.openai.errors import CHAT_FIELDS, COMPLETION_FIELDS, gateway_error_body
from services.gateway.openai.format import (
    DONE,
    Envelope,
    chat_chunk,
    completion_chunk,
    completion_logprobs,
    summed_usage,
    visible_text,
)
from services.gateway.openai.tool_calls import ToolCallStream
from services.gateway.pipeline.errors import GatewayError
from services.gateway.pipeline.fanout import Item, merge
from services.gateway.pipeline.results import Finished, KeepAlive, Token
from services.gateway.pipeline.stops import StopHoldback
from services.gateway.tgi.formatting import KEEPALIVE, sse


@dataclass
class ChoiceStream:
    """One choice while it streams."""

    holdback: StopHoldback
    finished: Finished | None = None
    tokens: list[Token] = field(default_factory=list)  # this step's token, for its logprobs

    def advance(self, item: Token | Finished) -> str:
        """The text this item lets the choice show; records the end."""
        if isinstance(item, Token):
            self.tokens = [item]
            return self.holdback.push(visible_text(item))
        self.tokens = [item.last_token] if item.last_token else []
        self.finished = item
        return self.holdback.finish(item)


async def choice_updates(
    streams: list[AsyncIterator[Item]], stop: list[str], keepalive_s: float
) -> AsyncIterator[tuple[int, ChoiceStream, str] | None]:
    """(choice index, its state, the text to show) per token or end; None for a keep-alive."""
    choices = [ChoiceStream(StopHoldback(stop)) for _ in streams]
    async for index, item in merge(streams, keepalive_s):
        if isinstance(item, KeepAlive):
            yield None
        else:
            choice = choices[index]
            yield index, choice, choice.advance(item)


async def chat_events(
    envelope: Envelope,
    streams: list[AsyncIterator[Item]],
    stop: list[str],
    has_logprobs: bool,
    keepalive_s: float,
    readers: list[ToolCallStream],
) -> AsyncIterator[str]:
    """`readers`: per choice, what turns its text into content or tool-call deltas."""
    ended: list[Finished] = []
    try:
        for index in range(len(streams)):
            yield sse(chat_chunk(envelope, index, {"role": "assistant", "content": ""}))
        async for update in choice_updates(streams, stop, keepalive_s):
            if update is None:
                yield KEEPALIVE
                continue
            index, choice, text = update
            reader = readers[index]
            tokens = choice.tokens if has_logprobs and choice.tokens else None
            deltas = reader.push(text)
            if choice.finished:
                deltas += reader.finish()
            if not deltas and (choice.finished or tokens or reader.plan.mode == "none"):
                deltas = [{"content": ""} if not choice.finished else {}]  # a chunk per token
            for number, delta in enumerate(deltas):
                is_last = number == len(deltas) - 1
                yield sse(
                    chat_chunk(
                        envelope,
                        index,
                        delta,
                        tokens if number == 0 else None,
                        choice.finished if is_last else None,
                        reader.num_calls > 0,
                    )
                )
            if choice.finished:
                ended.append(choice.finished)
        if envelope.has_usage_chunk:
            usage = summed_usage(ended[:1], ended)  # one prompt
            yield sse(envelope.usage_chunk("chat.completion.chunk", usage))
    except GatewayError as exc:
        yield sse(gateway_error_body(exc, CHAT_FIELDS))
    yield DONE


async def completion_events(
    envelope: Envelope,
    streams: list[AsyncIterator[Item]],
    prompts: list[str],
    stop: list[str],
    logprobs: int | None,
    echo: bool,
    keepalive_s: float,
) -> AsyncIterator[str]:
    """`streams` run prompt by prompt (choice i answers prompts[i // n]); echo opens each
    choice with its prompt."""
    n = len(streams) // len(prompts)
    ended: dict[int, Finished] = {}
    offsets = [len(prompts[i // n]) if echo else 0 for i in range(len(streams))]
    try:
        if echo:
            for index in range(len(streams)):
                yield sse(completion_chunk(envelope, index, prompts[index // n]))
        async for update in choice_updates(streams, stop, keepalive_s):
            if update is None:
                yield KEEPALIVE
                continue
            index, choice, text = update
            chosen = None
            if logprobs is not None and choice.tokens:
                chosen = completion_logprobs(choice.tokens, offsets[index])
                offsets[index] += sum(len(visible_text(t)) for t in choice.tokens)
            # a chunk per token, its text empty while held back (as vLLM streams): clients
            # time tokens by chunks
            yield sse(completion_chunk(envelope, index, text, chosen, choice.finished))
            if choice.finished:
                ended[index] = choice.finished
        if envelope.has_usage_chunk:
            firsts = [ended[i] for i in range(0, len(streams), n)]  # each prompt once
            usage = summed_usage(firsts, list(ended.values()))
            yield sse(envelope.usage_chunk("text_completion", usage))
    except GatewayError as exc:
        yield sse(gateway_error_body(exc, COMPLETION_FIELDS))
    yield DONE

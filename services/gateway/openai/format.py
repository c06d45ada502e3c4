"""OpenAI-shaped JSON for chat completions and completions, as OpenAI's API reference gives
them (pure).

Every response and chunk carries the request's own `id` (`chatcmpl-…` or `cmpl-…`, the same
in every chunk of one stream), `created`, `model` and `system_fingerprint`. Choices are indexed
prompt by prompt, `n` per prompt. Chunks carry `usage: null` only when the client asked for
the usage chunk (`stream_options.include_usage`), which then comes last with `choices: []`;
otherwise no chunk has a `usage` key.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from services.gateway.openai.params import openai_finish_reason
from services.gateway.openai.tool_calls import ToolCall
from services.gateway.pipeline.results import Finished, Token

DONE = "data: [DONE]\n\n"
NO_LOGPROB = -9999.0  # what OpenAI reports for a token the sampler had ruled out (-inf)


def response_id(prefix: str) -> str:
    """`chatcmpl-<32 hex>` or `cmpl-<32 hex>`: unique per request."""
    return f"{prefix}-{uuid.uuid4().hex}"


@dataclass(frozen=True)
class Envelope:
    """The fields every response object and chunk of one request repeats."""

    id: str  # response_id(): the same across one stream
    model: str
    created: int  # unix seconds
    system_fingerprint: str
    has_usage_chunk: bool = False  # stream_options.include_usage: chunks carry usage null

    def wrap(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": self.system_fingerprint,
            "choices": choices,
        }

    def answer(
        self, obj: str, choices: list[dict[str, Any]], usage: dict[str, int]
    ) -> dict[str, Any]:
        """A whole (non-streamed) answer: its choices and its usage."""
        answer = self.wrap(obj, choices)
        answer["usage"] = usage
        return answer

    def chunk(self, obj: str, choice: dict[str, Any]) -> dict[str, Any]:
        """A streamed chunk of one choice."""
        chunk = self.wrap(obj, [choice])
        if self.has_usage_chunk:
            chunk["usage"] = None
        return chunk

    def usage_chunk(self, obj: str, usage: dict[str, int]) -> dict[str, Any]:
        """The last chunk of stream_options.include_usage: no choices, the usage."""
        chunk = self.wrap(obj, [])
        chunk["usage"] = usage
        return chunk


def usage(num_prompt_tokens: int, num_completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_completion_tokens,
        "total_tokens": num_prompt_tokens + num_completion_tokens,
    }


def summed_usage(prompts: list[Finished], generations: list[Finished]) -> dict[str, int]:
    """Each prompt's tokens once (one Finished per prompt), every generation's tokens."""
    return usage(
        sum(one.num_input_tokens for one in prompts),
        sum(one.num_generated_tokens for one in generations),
    )


def visible_text(token: Token) -> str:
    """A token's text as the answer shows it: special tokens (EOS) show as ""."""
    return "" if token.special else token.text


def reported(logprob: float | None) -> float:
    return NO_LOGPROB if logprob is None else logprob


# --- chat ------------------------------------------------------------------------------------


def chat_token_logprob(token: Token) -> dict[str, Any]:
    """One entry of a chat choice's `logprobs.content`."""
    return {
        "token": token.text,
        "logprob": reported(token.logprob),
        "bytes": list(token.text.encode()),
        "top_logprobs": [
            {"token": top.text, "logprob": reported(top.logprob), "bytes": list(top.text.encode())}
            for top in token.top_tokens
        ],
    }


def chat_logprobs(tokens: list[Token]) -> dict[str, Any]:
    return {"content": [chat_token_logprob(token) for token in tokens]}


def chat_choice(
    index: int,
    tokens: list[Token],
    finished: Finished,
    has_logprobs: bool,
    read: Callable[[str], tuple[str, list[ToolCall]]] | None = None,
) -> dict:
    """A chat choice; `read` turns the text into (content, tool calls) when the request has
    tools to call."""
    content, calls = read(finished.text_before_stop) if read else (finished.text_before_stop, [])
    message: dict[str, Any] = {
        "role": "assistant",
        "content": content or None if calls else content,
    }
    if calls:
        message["tool_calls"] = [call.as_message() for call in calls]
    return {
        "index": index,
        "message": message,
        "logprobs": chat_logprobs(tokens) if has_logprobs else None,
        "finish_reason": openai_finish_reason(finished.finish_reason, bool(calls)),
    }


def chat_chunk(
    envelope: Envelope,
    index: int,
    delta: dict[str, Any],
    tokens: list[Token] | None = None,
    finished: Finished | None = None,
    has_tool_calls: bool = False,
) -> dict[str, Any]:
    """One choice's chunk: a delta, the logprobs of its tokens when asked (`tokens` not
    None), the finish reason on the choice's last chunk."""
    reason = openai_finish_reason(finished.finish_reason, has_tool_calls) if finished else None
    return envelope.chunk(
        "chat.completion.chunk",
        {
            "index": index,
            "delta": delta,
            "logprobs": None if tokens is None else chat_logprobs(tokens),
            "finish_reason": reason,
        },
    )


# --- completions -----------------------------------------------------------------------------


def completion_logprobs(tokens: list[Token], text_offset: int) -> dict[str, Any]:
    """The legacy `logprobs` object: each token, its logprob, its alternatives with it, and
    where its text starts in the choice's text (from `text_offset`)."""
    offsets = []
    for token in tokens:
        offsets.append(text_offset)
        text_offset += len(visible_text(token))
    return {
        "tokens": [token.text for token in tokens],
        "token_logprobs": [reported(token.logprob) for token in tokens],
        "top_logprobs": [
            {
                **{top.text: reported(top.logprob) for top in token.top_tokens},
                token.text: reported(token.logprob),
            }
            for token in tokens
        ],
        "text_offset": offsets,
    }


def completion_choice(index: int, text: str, logprobs: dict | None, finished: Finished) -> dict:
    return {
        "index": index,
        "text": text,
        "logprobs": logprobs,
        "finish_reason": openai_finish_reason(finished.finish_reason),
    }


def completion_chunk(
    envelope: Envelope,
    index: int,
    text: str,
    logprobs: dict[str, Any] | None = None,
    finished: Finished | None = None,
) -> dict[str, Any]:
    return envelope.chunk(
        "text_completion",
        {
            "index": index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": openai_finish_reason(finished.finish_reason) if finished else None,
        },
    )

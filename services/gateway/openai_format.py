"""OpenAI-shaped JSON for chat completions and completions, as TGI answers them (pure).

Shapes follow reference §9.2/§9.3 (chat) and §10 (completions): `id` is always "", one choice
per chat request, `system_fingerprint` is `<version>-native`, stream errors claim 422.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from services.gateway.errors import GatewayError
from services.gateway.formatting import timing_headers
from services.gateway.generation import Finished, Token
from services.gateway.openai_params import openai_finish_reason

DONE = "data: [DONE]\n\n"


@dataclass(frozen=True)
class Envelope:
    """The fields every response object repeats."""

    model: str
    created: int  # unix seconds
    system_fingerprint: str

    def wrap(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "object": obj,
            "id": "",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": self.system_fingerprint,
            "choices": choices,
        }


def usage(num_prompt_tokens: int, num_completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_completion_tokens,
        "total_tokens": num_prompt_tokens + num_completion_tokens,
    }


def finished_usage(finished: Finished) -> dict[str, int]:
    return usage(finished.num_input_tokens, finished.num_generated_tokens)


def token_logprob(token: Token) -> dict[str, Any]:
    return {
        "token": token.text,
        "logprob": token.logprob,
        "top_logprobs": [{"token": top.text, "logprob": top.logprob} for top in token.top_tokens],
    }


def visible_text(token: Token) -> str:
    """A token's text in a stream delta: special tokens (EOS) show as ""."""
    return "" if token.special else token.text


def chat_completion(
    envelope: Envelope, tokens: list[Token], finished: Finished, has_logprobs: bool
) -> dict[str, Any]:
    choice = {
        "index": 0,
        "message": {"role": "assistant", "content": finished.generated_text},
        "logprobs": {"content": [token_logprob(t) for t in tokens]} if has_logprobs else None,
        "finish_reason": openai_finish_reason(finished.finish_reason),
    }
    answer = envelope.wrap("chat.completion", [choice])
    answer["usage"] = finished_usage(finished)
    return answer


def chat_chunk(
    envelope: Envelope, token: Token | None, finished: Finished | None, has_logprobs: bool
) -> dict[str, Any]:
    """One token's chunk; `finished` on the last one. `token` None: a finish without a token."""
    choice = {
        "index": 0,
        "delta": {"role": "assistant", "content": visible_text(token) if token else ""},
        "logprobs": (
            {"content": [token_logprob(token)]} if has_logprobs and token is not None else None
        ),
        "finish_reason": openai_finish_reason(finished.finish_reason) if finished else None,
    }
    chunk = envelope.wrap("chat.completion.chunk", [choice])
    chunk["usage"] = None
    return chunk


def chat_usage_chunk(envelope: Envelope, finished: Finished) -> dict[str, Any]:
    """The extra chunk of stream_options.include_usage: no choices, the usage."""
    chunk = envelope.wrap("chat.completion.chunk", [])
    chunk["usage"] = finished_usage(finished)
    return chunk


def completion(envelope: Envelope, results: list[tuple[list[Token], Finished]]) -> dict[str, Any]:
    """Non-stream completions: one choice per prompt, usage summed over prompts."""
    choices = [
        {
            "index": index,
            "text": finished.generated_text,
            "logprobs": None,
            "finish_reason": openai_finish_reason(finished.finish_reason),
        }
        for index, (_, finished) in enumerate(results)
    ]
    answer = envelope.wrap("text_completion", choices)
    answer["usage"] = usage(
        sum(finished.num_input_tokens for _, finished in results),
        sum(finished.num_generated_tokens for _, finished in results),
    )
    return answer


def completion_chunk(
    envelope: Envelope, index: int, text: str, finished: Finished | None
) -> dict[str, Any]:
    """A streamed completion chunk: finish_reason "" until the prompt's last chunk, which has
    the raw (not renamed) finish_reason and that prompt's usage (quirks)."""
    choice = {
        "index": index,
        "text": text,
        "logprobs": None,
        "finish_reason": finished.finish_reason.value if finished else "",
    }
    chunk = envelope.wrap("text_completion", [choice])
    if finished is not None:
        chunk["usage"] = finished_usage(finished)
    return chunk


def stream_error(exc: GatewayError) -> dict[str, Any]:
    """In-stream error of the OpenAI routes: always 422, whatever the cause (TGI quirk)."""
    return {"error": {"message": exc.message, "http_status_code": 422}}


def summed_headers(
    finished: list[Finished], compute_type: str, num_characters: int
) -> dict[str, str]:
    """/v1/completions non-stream headers: per-prompt values summed, no x-compute-time."""
    totals: dict[str, int] = {}
    for one in finished:
        for name, value in timing_headers(one, compute_type, 0).items():
            if name not in ("x-compute-type", "x-compute-time", "x-compute-characters"):
                totals[name] = totals.get(name, 0) + int(value)
    return {
        "x-compute-type": compute_type,
        "x-compute-characters": str(num_characters),
        **{name: str(value) for name, value in totals.items()},
    }

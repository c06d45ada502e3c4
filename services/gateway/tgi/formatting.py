"""TGI JSON shapes for generated tokens, details, SSE events and timing headers (pure)."""

from __future__ import annotations

from typing import Any

import orjson

from services.gateway.pipeline.results import Finished, Token


def token_json(token: Token) -> dict[str, Any]:
    return {"id": token.id, "text": token.text, "logprob": token.logprob, "special": token.special}


KEEPALIVE = ":\n\n"  # an SSE comment: keeps proxies from closing a quiet stream


def stream_headers(compute_type: str, num_characters: int) -> dict[str, str]:
    """The headers of every SSE answer, sent before its first event."""
    return {
        "x-compute-type": compute_type,
        "x-compute-characters": str(num_characters),
        "X-Accel-Buffering": "no",
        "Cache-Control": "no-cache",
    }


def sse(payload: dict[str, Any]) -> str:
    """One SSE event: a single `data: <json>` line and a blank line (compact UTF-8 JSON, as
    TGI's; orjson: a tenth of json.dumps' CPU per streamed token)."""
    return f"data: {orjson.dumps(payload).decode()}\n\n"


def stream_event(
    token: Token, top_n_tokens: int, generated_text: str | None, details: dict | None
) -> dict[str, Any]:
    event: dict[str, Any] = {"index": token.index, "token": token_json(token)}
    if top_n_tokens > 0:
        event["top_tokens"] = [token_json(top) for top in token.top_tokens]
    event["generated_text"] = generated_text
    event["details"] = details
    return event


def stream_details(finished: Finished) -> dict[str, Any]:
    return {
        "finish_reason": finished.finish_reason.value,
        "generated_tokens": finished.num_generated_tokens,
        "seed": finished.seed,
        "input_length": finished.num_input_tokens,
    }


def sequence_details(tokens: list[Token], finished: Finished, top_n_tokens: int) -> dict:
    """`details` of a /generate answer (without best_of_sequences)."""
    details: dict[str, Any] = {
        "finish_reason": finished.finish_reason.value,
        "generated_tokens": finished.num_generated_tokens,
        "seed": finished.seed,
        "prefill": [{"id": t.id, "text": t.text, "logprob": t.logprob} for t in finished.prefill],
        "tokens": [token_json(token) for token in tokens],
    }
    if top_n_tokens > 0:
        details["top_tokens"] = [[token_json(t) for t in token.top_tokens] for token in tokens]
    return details


def timing_headers(finished: Finished, compute_type: str, num_characters: int) -> dict[str, str]:
    """TGI's x-* headers of a successful non-streaming generation."""
    per_token_ms = (
        finished.inference_s * 1000 / finished.num_generated_tokens
        if finished.num_generated_tokens
        else 0
    )
    return {
        "x-compute-type": compute_type,
        "x-compute-time": f"{finished.total_s:.6f}",
        "x-compute-characters": str(num_characters),
        "x-total-time": str(int(finished.total_s * 1000)),
        "x-validation-time": str(int(finished.validation_s * 1000)),
        "x-queue-time": str(int(finished.queue_s * 1000)),
        "x-inference-time": str(int(finished.inference_s * 1000)),
        "x-time-per-token": str(int(per_token_ms)),
        "x-prompt-tokens": str(finished.num_input_tokens),
        "x-generated-tokens": str(finished.num_generated_tokens),
    }


def summed_headers(
    finished: list[Finished], compute_type: str, num_characters: int
) -> dict[str, str]:
    """/v1/completions non-stream headers: per-generation values summed, no x-compute-time."""
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


def mean_logprob(tokens: list[Token]) -> float:
    values = [t.logprob for t in tokens if t.logprob is not None]
    return sum(values) / len(values) if values else float("-inf")

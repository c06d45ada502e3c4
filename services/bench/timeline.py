"""One streamed request as the client saw it: the arrival time of every SSE event of
/generate_stream, turned into TTFT, inter-token latencies and end-to-end latency.

Inputs come from services.bench.client (event times on time.perf_counter's clock, payloads as
decoded JSON); outputs go to services.bench.report. Pure: tests feed fabricated timelines."""

from __future__ import annotations

import json
from dataclasses import dataclass, field


@dataclass
class RequestRecord:
    """What one request measured. Times are seconds on one monotonic clock."""

    sent_at: float  # when the request was sent
    event_times: list[float] = field(default_factory=list)  # arrival of each `data:` event
    events: list[dict] = field(default_factory=list)  # decoded payloads, same order
    done_at: float | None = None  # when the stream ended
    error: str | None = None  # transport error, HTTP status or error event; None when it worked
    # `data:` lines with their arrival times, as received; decoded into events after the level
    raw_events: list[tuple[bytes, float]] = field(default_factory=list)
    reported_tokens: int | None = None  # OpenAI streams: the usage chunk's completion_tokens

    @property
    def num_tokens(self) -> int:
        """Generated tokens: the final event's details.generated_tokens when present (a
        tokenless finish repeats the last token event), else the number of token events. An
        OpenAI stream's usage count when it gave one (a chunk may carry several tokens, or
        none while a character is incomplete)."""
        if self.reported_tokens is not None and self.token_times:
            return self.reported_tokens
        if self.events:
            details = self.events[-1].get("details") or {}
            if "generated_tokens" in details:
                return min(int(details["generated_tokens"]), len(self.token_times))
        return len(self.token_times)

    @property
    def token_times(self) -> list[float]:
        """Arrival time of each token event."""
        return [t for t, event in zip(self.event_times, self.events) if "token" in event]

    @property
    def token_ids(self) -> list[int]:
        ids = [event["token"]["id"] for event in self.events if "token" in event]
        return ids[: self.num_tokens]

    @property
    def is_ok(self) -> bool:
        return self.error is None and self.num_tokens > 0

    @property
    def ttft_s(self) -> float:
        """Time to first token: first token event minus send time."""
        return self.token_times[0] - self.sent_at

    @property
    def itls_s(self) -> list[float]:
        """Inter-token latencies: gaps between consecutive token events (num_tokens - 1; for
        an OpenAI stream, between its chunks)."""
        times = self.token_times[: self.num_tokens]
        return [b - a for a, b in zip(times, times[1:])]

    @property
    def e2e_s(self) -> float:
        """End-to-end latency: last event (or the stream's end) minus send time."""
        end = self.event_times[-1] if self.event_times else self.done_at
        return (end if end is not None else self.sent_at) - self.sent_at

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first; None for one-token answers."""
        if self.num_tokens < 2:
            return None
        times = self.token_times[: self.num_tokens]
        return (times[-1] - times[0]) / (self.num_tokens - 1)


def parse_sse_line(line: str) -> dict | None:
    """The JSON payload of one SSE `data:` line; None for blank lines, comments (keep-alives
    are `:`) and other fields."""
    if not line.startswith("data:"):
        return None
    data = line[len("data:") :].strip()
    return None if data == "[DONE]" else json.loads(data)


def record_event(record: RequestRecord, payload: dict, at: float) -> None:
    """Add one decoded event to the record; an `error` event ends it as failed."""
    if "error" in payload:
        record.error = f"{payload.get('error_type', 'error')}: {payload['error']}"
        return
    record.event_times.append(at)
    record.events.append(payload)

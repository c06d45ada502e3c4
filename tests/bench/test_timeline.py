"""TTFT, inter-token latencies and E2E from a fabricated /generate_stream timeline."""

from __future__ import annotations

import pytest

from services.bench.client import LevelRun
from services.bench.report import level_metrics
from services.bench.timeline import RequestRecord, parse_sse_line, record_event


def token(index: int, token_id: int, final: int | None = None) -> str:
    """One SSE line as the gateway writes it; `final` adds details.generated_tokens."""
    import json

    event = {
        "index": index,
        "token": {"id": token_id, "text": "x", "logprob": -0.1, "special": False},
        "generated_text": None if final is None else "x" * final,
        "details": None
        if final is None
        else {"finish_reason": "length", "generated_tokens": final},
    }
    return "data: " + json.dumps(event)


def replay(sent_at: float, timeline: list[tuple[float, str]]) -> RequestRecord:
    record = RequestRecord(sent_at=sent_at)
    for at, line in timeline:
        payload = parse_sse_line(line)
        if payload is not None:
            record_event(record, payload, at)
    record.done_at = timeline[-1][0] + 0.001
    return record


def test_ttft_itl_e2e():
    record = replay(
        10.0,
        [
            (10.0, ":"),  # keep-alive comment: ignored
            (10.25, token(1, 7)),
            (10.0, ""),
            (10.30, token(2, 8)),
            (10.40, token(3, 9)),
            (10.60, token(4, 2, final=4)),
        ],
    )
    assert record.is_ok
    assert record.num_tokens == 4
    assert record.token_ids == [7, 8, 9, 2]
    assert record.ttft_s == pytest.approx(0.25)
    assert record.itls_s == pytest.approx([0.05, 0.10, 0.20])
    assert record.e2e_s == pytest.approx(0.60)
    assert record.tpot_s == pytest.approx(0.35 / 3)


def test_tokenless_finish_repeats_the_last_token_and_is_not_counted():
    record = replay(0.0, [(0.1, token(1, 5)), (0.2, token(2, 6)), (0.5, token(2, 6, final=2))])
    assert record.num_tokens == 2
    assert record.token_ids == [5, 6]
    assert record.itls_s == pytest.approx([0.1])
    assert record.e2e_s == pytest.approx(0.5)  # the finish event still ends the request


def test_error_event_fails_the_request():
    line = 'data: {"error": "Input validation error", "error_type": "validation"}'
    record = replay(0.0, [(0.1, line)])
    assert not record.is_ok
    assert record.error == "validation: Input validation error"


def test_level_metrics_pool_itls_and_skip_failures():
    a = replay(0.0, [(0.1, token(1, 1)), (0.2, token(2, 1)), (0.4, token(3, 1, final=3))])
    b = replay(0.0, [(0.3, token(1, 1)), (0.6, token(2, 1, final=2))])
    failed = RequestRecord(sent_at=0.0, error="HTTP 503: overloaded")
    metrics = level_metrics(LevelRun("concurrency", 2, [a, b, failed], wall_s=1.0))
    assert metrics["num_completed"] == 2 and metrics["num_failed"] == 1
    assert metrics["errors"] == ["HTTP 503: overloaded"]
    assert metrics["output_tokens"] == 5
    assert metrics["output_token_throughput"] == 5.0
    assert metrics["request_throughput"] == 2.0
    assert metrics["ttft"]["count"] == 2 and metrics["ttft"]["p50_ms"] == pytest.approx(200.0)
    assert metrics["itl"]["count"] == 3  # 2 gaps + 1 gap, pooled
    assert metrics["itl"]["max_ms"] == pytest.approx(300.0)
    assert metrics["e2e"]["p50_ms"] == pytest.approx(500.0)

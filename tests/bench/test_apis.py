"""The bench's two APIs: the requests they send and how their streams become records."""

from __future__ import annotations

from services.bench.apis import Api
from services.bench.timeline import RequestRecord, parse_sse_line
from services.bench.workload import Case


def test_request_bodies():
    case = Case("hello", 7)
    assert Api().path == "/generate_stream"
    assert Api().body(case) == {
        "inputs": "hello",
        "parameters": {"max_new_tokens": 7, "details": True},
    }
    openai = Api("openai", "served-model")
    assert openai.path == "/v1/completions"
    body = openai.body(case)
    assert body["model"] == "served-model" and body["prompt"] == "hello"
    assert body["max_tokens"] == 7 and body["temperature"] == 0 and body["ignore_eos"]
    assert body["stream"] and body["stream_options"] == {"include_usage": True}
    # a case naming a LoRA adapter (--lora): OpenAI's `model`, TGI's `adapter_id`
    adapted = Case("hello", 7, adapter="lora1")
    assert openai.body(adapted)["model"] == "lora1"
    assert Api().body(adapted)["parameters"]["adapter_id"] == "lora1"


def test_openai_stream_to_a_record():
    """Every chunk of a choice is a token event, empty text included (a token whose text is
    held back); a finish chunk without text is not; the usage chunk gives the count (6 tokens
    in 5 chunks here: one carried two); [DONE] is no event."""
    api, record = Api("openai", "m"), RequestRecord(sent_at=0.0)
    lines = [
        'data: {"choices": [{"index": 0, "text": "a", "finish_reason": null}], "usage": null}',
        'data: {"choices": [{"index": 0, "text": "", "finish_reason": null}]}',
        'data: {"choices": [{"index": 0, "text": "bc", "finish_reason": null}]}',
        'data: {"choices": [{"index": 0, "text": "d", "finish_reason": null}]}',
        'data: {"choices": [{"index": 0, "text": "e", "finish_reason": null}]}',
        'data: {"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}',
        'data: {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 6}}',
        "data: [DONE]",
    ]
    for at, line in enumerate(lines, start=1):
        payload = parse_sse_line(line)
        if payload is not None:
            api.record(record, payload, float(at))
    assert record.token_times == [1.0, 2.0, 3.0, 4.0, 5.0]
    assert record.num_tokens == 6 and record.is_ok
    assert record.ttft_s == 1.0 and record.itls_s == [1.0, 1.0, 1.0, 1.0]
    assert record.tpot_s == (5.0 - 1.0) / 5
    failed = RequestRecord(sent_at=0.0)
    api.record(failed, {"error": {"message": "boom", "type": "server_error"}}, 1.0)
    assert failed.error == "boom" and not failed.is_ok

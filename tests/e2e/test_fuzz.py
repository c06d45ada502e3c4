"""Fuzzing the live gateway: nothing it is sent gives a 5xx, and nothing it answers
contradicts its own /openapi.json.

schemathesis generates requests for every operation of /openapi.json and holds each answer to
the document: no server error, a documented status, a documented content type, a body (JSON,
or each server-sent event) of the documented shape. hypothesis throws random JSON values at
each /generate parameter. Both run on a gateway with tiny token limits so that every accepted
generation is short; budgets keep the module near a minute."""

from __future__ import annotations

import json
import time

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

pytestmark = pytest.mark.timeout(180)
EXAMPLES_PER_OPERATION = 25
SCHEMA_BUDGET_S = 60.0
CHECKS = (
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
)
OK = {200, 400, 413, 415, 422, 429}
PARAMETERS = [
    "best_of",
    "temperature",
    "repetition_penalty",
    "frequency_penalty",
    "top_k",
    "top_p",
    "typical_p",
    "do_sample",
    "max_new_tokens",
    "return_full_text",
    "stop",
    "truncate",
    "watermark",
    "details",
    "decoder_input_details",
    "seed",
    "top_n_tokens",
    "grammar",
    "adapter_id",
]
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.sampled_from([0, 1, -1, 2, 0.5, 1.0, 2**32, 2**64, 1e30, -1e30, 5e-324])
    | st.text(max_size=12),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)


@pytest.fixture(scope="module")
def fuzz_gateway(tiny_cluster) -> str:
    return tiny_cluster.add_gateway(
        "--max-total-tokens", "40", "--max-input-tokens", "32", "--request-timeout", "20"
    )


CHAT = [{"role": "user", "content": "Hi"}]
# answers the random requests rarely reach (streams of several choices with logprobs, the
# in-stream errors), each held to the document too: (path, body, expected status)
KNOWN = [
    ("/generate", {"inputs": "Hi", "parameters": {"max_new_tokens": 3, "details": True}}, 200),
    ("/generate", {"inputs": "Hi", "parameters": {"max_new_tokens": 0}}, 422),
    ("/generate_stream", {"inputs": "Hi", "parameters": {"max_new_tokens": 3}}, 200),
    ("/generate_stream", {"inputs": "Hi", "parameters": {"max_new_tokens": 0}}, 200),  # error
    ("/", {"inputs": "Hi", "parameters": {"max_new_tokens": 2}, "stream": True}, 200),
    ("/", {"inputs": "Hi", "parameters": {"max_new_tokens": 2, "top_n_tokens": 2}}, 200),
    ("/tokenize", {"inputs": "Hi"}, 200),
    ("/chat_tokenize", {"messages": CHAT}, 200),
    ("/vertex", {"instances": [{"inputs": "Hi", "parameters": {"max_new_tokens": 2}}]}, 200),
    ("/vertex", {"instances": []}, 422),
    ("/invocations", {"messages": CHAT, "max_tokens": 2}, 200),
    ("/invocations", {"prompt": "Hi", "max_tokens": 2, "stream": True}, 200),
    ("/invocations", {"inputs": "Hi", "parameters": {"max_new_tokens": 2}}, 200),
    (
        "/v1/chat/completions",
        {
            "messages": CHAT,
            "max_tokens": 3,
            "n": 2,
            "logprobs": True,
            "top_logprobs": 2,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
        200,
    ),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 3, "n": 2, "logprobs": True}, 200),
    ("/v1/chat/completions", {"messages": CHAT, "top_p": 5.0}, 400),
    (
        "/v1/completions",
        {"prompt": ["a", "b"], "max_tokens": 3, "logprobs": 2, "stream": True, "stop": "x"},
        200,
    ),
    ("/v1/completions", {"prompt": "a", "max_tokens": 3, "best_of": 2, "logprobs": 0}, 200),
    ("/v1/completions", {"prompt": "a", "echo": True, "max_tokens": 2}, 200),
    ("/v1/completions", {"prompt": "a", "n": 0}, 400),
]


@pytest.mark.parametrize(("path", "body", "status"), KNOWN)
def test_known_answers_are_as_documented(fuzz_gateway, path, body, status):
    schema = schemathesis.openapi.from_url(f"{fuzz_gateway}/openapi.json")
    case = schema[path]["POST"].Case(body=body, media_type="application/json")
    response = case.call(base_url=fuzz_gateway, timeout=30)
    assert response.status_code == status, response.text
    case.validate_response(response, checks=CHECKS)


def is_tgi_body(response: httpx.Response) -> bool:
    """The shapes TGI answers with: plain text for body rejections, else its JSON."""
    if response.status_code in (400, 413, 415) or response.text.startswith("Failed to"):
        return True
    body = response.json()
    if response.status_code == 200:
        return isinstance(body, dict) and isinstance(body.get("generated_text"), str)
    return set(body) == {"error", "error_type"} and isinstance(body["error"], str)


def test_openapi_no_server_errors_and_answers_as_documented(fuzz_gateway):
    schema = schemathesis.openapi.from_url(f"{fuzz_gateway}/openapi.json")
    started = time.monotonic()
    tested = []
    required = ("/generate", "/generate_stream", "/v1/chat/completions", "/v1/completions")
    operations = [result.ok() for result in schema.get_all_operations()]
    # the main routes first, whatever the host's speed; the rest while the budget lasts
    operations.sort(key=lambda op: not any(op.label.endswith(f" {r}") for r in required))
    for operation in operations:
        is_required = any(operation.label.endswith(f" {route}") for route in required)
        if not is_required and time.monotonic() - started > SCHEMA_BUDGET_S:
            break

        @settings(
            max_examples=EXAMPLES_PER_OPERATION,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        @given(case=operation.as_strategy())
        def check(case):
            response = case.call(base_url=fuzz_gateway, timeout=30)
            case.validate_response(response, checks=CHECKS)

        check()
        tested.append(operation.label)
    print(f"schemathesis: {len(tested)} operations in {time.monotonic() - started:.1f} s")
    for route in required:
        assert any(label.endswith(f" {route}") for label in tested), (route, tested)


@pytest.mark.parametrize("name", PARAMETERS)
def test_generate_parameter_fuzz(fuzz_gateway, name):
    with httpx.Client(base_url=fuzz_gateway, timeout=30) as http:

        @settings(max_examples=6, deadline=None, database=None)
        @given(value=json_values, inputs=st.sampled_from(["Hi", "", " ", "😀 שלום e\u0301"]))
        def check(value, inputs):
            body = {"inputs": inputs, "parameters": {name: value, "max_new_tokens": 4}}
            if name == "max_new_tokens":
                body["parameters"] = {name: value}
            response = http.post(
                "/generate",
                content=json.dumps(body).encode(),
                headers={"content-type": "application/json"},
            )
            assert response.status_code in OK, (body, response.status_code, response.text)
            assert is_tgi_body(response), (body, response.text)

        check()

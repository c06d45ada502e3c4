"""TGI's remaining routes against the real stack: /chat_tokenize, /invocations, /vertex and the
OpenAPI document's two addresses."""

from __future__ import annotations

import httpx
import pytest

from tests.e2e.test_pipeline import prompt_text
from tests.support.reference import greedy_ids, tokenizer

pytestmark = pytest.mark.integration

MESSAGES = [{"role": "user", "content": "the cat sat on the mat"}]


def test_chat_tokenize_applies_the_template(tiny_cluster, tiny_llama):
    url = tiny_cluster.gateway_urls[0]
    body = httpx.post(f"{url}/chat_tokenize", json={"messages": MESSAGES}, timeout=30).json()
    expected = tokenizer(tiny_llama).apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=True
    )
    assert body["templated_text"] == expected
    ids = tokenizer(tiny_llama)(expected, add_special_tokens=False).input_ids
    assert [t["id"] for t in body["tokenize_response"]] == ids


def test_invocations_dispatch_on_the_body(tiny_cluster, tiny_llama):
    url = tiny_cluster.gateway_urls[0]
    prompt = prompt_text(8, 6)
    generate = httpx.post(
        f"{url}/invocations",
        timeout=60,
        json={"inputs": prompt, "parameters": {"max_new_tokens": 5, "details": True}},
    ).json()
    assert isinstance(generate, list)  # POST / semantics
    assert [t["id"] for t in generate[0]["details"]["tokens"]] == greedy_ids(
        tiny_llama, prompt, 5, [2]
    )
    chat = httpx.post(
        f"{url}/invocations",
        timeout=60,
        json={"messages": MESSAGES, "max_tokens": 4, "temperature": 0},
    ).json()
    assert chat["object"] == "chat.completion"
    completion = httpx.post(
        f"{url}/invocations", timeout=60, json={"prompt": prompt, "max_tokens": 4, "temperature": 0}
    ).json()
    assert completion["object"] == "text_completion"


def test_vertex_predictions_and_empty_instances(tiny_cluster, tiny_llama):
    url = tiny_cluster.gateway_urls[1]
    prompt = prompt_text(9, 5)
    body = httpx.post(
        f"{url}/vertex",
        timeout=60,
        json={
            "instances": [
                {"inputs": prompt, "parameters": {"max_new_tokens": 6}},
                {"messages": MESSAGES, "max_tokens": 3, "temperature": 0},
            ]
        },
    ).json()
    tok = tokenizer(tiny_llama)
    ids = greedy_ids(tiny_llama, prompt, 6, [2])
    prompt_ids = tok(prompt).input_ids
    expected = tok.decode(prompt_ids + ids, skip_special_tokens=True)[
        len(tok.decode(prompt_ids, skip_special_tokens=True)) :
    ]
    assert body["predictions"][0] == expected
    assert isinstance(body["predictions"][1], str)
    empty = httpx.post(f"{url}/vertex", json={"instances": []}, timeout=30)
    assert empty.status_code == 422
    assert empty.json() == {  # TGI says error_type "Input validation error": a misprint
        "error": "Input validation error: `instances` cannot be empty",
        "error_type": "validation",
    }
    invalid = httpx.post(
        f"{url}/vertex",
        timeout=30,
        json={"instances": [{"inputs": "Hi", "parameters": {"max_new_tokens": 0}}]},
    )
    assert invalid.status_code == 422 and invalid.json()["error_type"] == "validation"


def test_openapi_is_served_at_both_addresses(tiny_cluster):
    url = tiny_cluster.gateway_urls[0]
    document = httpx.get(f"{url}/openapi.json").json()
    assert httpx.get(f"{url}/api-doc/openapi.json").json() == document
    for path in (
        "/generate",
        "/generate_stream",
        "/v1/chat/completions",
        "/v1/completions",
        "/vertex",
        "/chat_tokenize",
        "/tokenize",
    ):
        assert "requestBody" in document["paths"][path]["post"], path

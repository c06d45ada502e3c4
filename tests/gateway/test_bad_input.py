"""Bad input never gets a 5xx: every rejection has TGI's status (400/413/415/422) and shape,
over real HTTP with a stand-in worker. Also the --api-key coverage of the compat routes."""

from __future__ import annotations

import json

import httpx
import pytest

from services.gateway.pipeline.body import loads_strict
from shared.settings import Settings
from tests.support.gateway_server import serve, sse_events

JSON = {"content-type": "application/json"}


@pytest.fixture
def settings(settings) -> Settings:
    """The gateway fixture's settings with a small body limit."""
    return settings.model_copy(update={"payload_limit": 4000})


def is_tgi_error(response: httpx.Response, error_type: str = "validation") -> bool:
    body = response.json()
    return set(body) == {"error", "error_type"} and body["error_type"] == error_type


def test_strict_json_decoding():
    assert loads_strict('{"a": "\\ud83d\\ude00 שלום e\u0301"}'.encode()) == {
        "a": "\U0001f600 שלום e\u0301"
    }
    assert loads_strict(b"[1e30, -0.0, 18446744073709551616]") == [1e30, -0.0, 2**64]
    for raw in [
        b'{"inputs": "\\ud800"}',
        b'{"inputs": "x\\udfff"}',
        b'{"\\udc00": 1}',
        b'{"inputs": "x", "parameters": {"temperature": NaN}}',
        b'{"inputs": "x", "parameters": {"temperature": Infinity}}',
        b'{"inputs": "x", "parameters": {"temperature": 1e999}}',
        b'{"inputs": "\xff\xfe"}',
        b"[" * 100_000,
    ]:
        with pytest.raises(ValueError):
            loads_strict(raw)


@pytest.mark.parametrize(
    ("raw", "status"),
    [
        (b'{"inputs": "x"', 400),
        (b'{"inputs": "\xc3\x28"}', 400),  # invalid UTF-8
        (b'\xef\xbb\xbf{"inputs": "x"}', 400),  # a BOM is not JSON either
        (b'{"inputs": "\\ud800"}', 400),  # lone surrogate
        (b'{"inputs": "x", "parameters": {"temperature": NaN}}', 400),
        (b'{"inputs": "x", "parameters": {"top_p": 1e400}}', 400),
        (b"[" * 1900 + b"]" * 1900, 400),  # nesting deeper than serde_json allows
        (b"", 400),
        (b"null", 422),
        (b'"just a string"', 422),
        (b'{"inputs": ["a"]}', 422),
        (b'{"inputs": "x", "parameters": []}', 422),
        (b'{"inputs": "x", "parameters": {"max_new_tokens": 1e30}}', 422),
        (
            b'{"inputs": "x", "parameters": {"max_new_tokens": 1000000000000000000000000000000}}',
            422,
        ),
        (b'{"inputs": "x", "parameters": {"max_new_tokens": -5}}', 422),
        (b'{"inputs": "x", "parameters": {"seed": 1180591620717411303424}}', 422),  # 2**70
        (b'{"inputs": "x", "parameters": {"top_k": 1099511627776}}', 422),  # 2**40
        (b'{"inputs": "x", "parameters": {"best_of": 18446744073709551616}}', 422),
        (b'{"inputs": "x", "parameters": {"truncate": -1}}', 422),
        (b'{"inputs": "x", "parameters": {"stop": [1, 2]}}', 422),
        (b'{"inputs": "x", "parameters": {"grammar": "regex"}}', 422),
        (b'{"inputs": "x", "parameters": {"do_sample": "yes"}}', 422),
        (b'{"inputs": "x", "parameters": {"temperature": "hot"}}', 422),
    ],
)
async def test_body_rejections(http, raw, status):
    for route in ("/generate", "/generate_stream", "/"):
        response = await http.post(route, content=raw, headers=JSON)
        assert response.status_code == status, (route, raw[:80], response.text)


async def test_size_and_content_type(http):
    big = json.dumps({"inputs": "x" * 5000}).encode()
    for route in ("/generate", "/generate_stream", "/v1/chat/completions", "/v1/completions"):
        assert (await http.post(route, content=big, headers=JSON)).status_code == 413
        assert (await http.post(route, content=b'{"inputs":"x"}')).status_code == 415

    async def chunks():  # chunked, no Content-Length
        for _ in range(10):
            yield b"x" * 1000

    assert (await http.post("/generate", content=chunks(), headers=JSON)).status_code == 413


@pytest.mark.parametrize(
    "parameters",
    [
        {"max_new_tokens": 0},
        {"max_new_tokens": 4_294_967_295},  # u32::MAX: over max_total_tokens, still a 422
        {"temperature": 0.0},
        {"temperature": -1e308},
        {"top_p": 1.0},
        {"top_k": 0},
        {"top_k": -(2**31)},
        {"typical_p": 1.0},
        {"repetition_penalty": 0.0},
        {"frequency_penalty": 1e300},
        {"truncate": 2**64 - 1},
        {"top_n_tokens": 2**32 - 1},
        {"best_of": 2**64 - 1, "do_sample": True},
        {"stop": ["s"] * 100},
        {"grammar": {"type": "json", "value": {"type": "nonsense"}}},
        {"grammar": {"type": "regex", "value": "(unclosed"}},
        {"grammar": {"type": "json", "value": "{not json"}},
        {"grammar": {"type": "nonsense", "value": 5}},
    ],
)
async def test_value_rejections_are_422(http, parameters):
    response = await http.post("/generate", json={"inputs": "Hi", "parameters": parameters})
    assert response.status_code == 422, (parameters, response.text)
    assert response.text.startswith("Failed to deserialize") or is_tgi_error(response)


@pytest.mark.parametrize(
    "inputs",
    [
        "😀👩‍👧",
        "שלום עולם مرحبا",  # RTL
        "e\u0301\u0302\u0303 Z\u0351\u0352\u0353",  # combining marks
        "\u202e\u200f\u200b\ufeff",  # bidi override, RLM, zero-width, BOM inside text
        "\x00\x01\x7f",
        " ",
        "\n\t  \n",
        "\U0010ffff",
    ],
)
async def test_unicode_prompts(http, peer, inputs):
    parameters = {"max_new_tokens": 3, "return_full_text": True, "details": True}
    response = await http.post("/generate", json={"inputs": inputs, "parameters": parameters})
    assert response.status_code == 200, response.text
    assert response.json()["generated_text"].startswith(inputs)
    response = await http.post("/generate_stream", json={"inputs": inputs, "parameters": {}})
    assert response.status_code == 200
    events = sse_events(response.text)
    assert events[-1].get("generated_text") is not None or "error" not in events[-1]
    stops = {"max_new_tokens": 3, "stop": [inputs, "😀", "\u0301"]}
    response = await http.post("/generate", json={"inputs": "Hi", "parameters": stops})
    assert response.status_code == 200, response.text


async def test_empty_prompt(http):
    response = await http.post("/generate", json={"inputs": "", "parameters": {}})
    assert response.status_code == 422 and is_tgi_error(response)
    assert "`inputs` cannot be empty" in response.json()["error"]
    response = await http.post("/generate_stream", json={"inputs": ""})
    assert response.status_code == 200 and sse_events(response.text)[0]["error_type"] == (
        "validation"
    )


async def test_openai_bad_input(http):
    for raw in [
        b'{"messages": [{"role": "user", "content": "\\ud800"}]}',
        b'{"messages": "x"',
        b'{"prompt": "x", "max_tokens": 1e999}',
    ]:
        for route in ("/v1/chat/completions", "/v1/completions", "/chat_tokenize"):
            response = await http.post(route, content=raw, headers=JSON)
            assert response.status_code == 400, (route, raw, response.text)
    for body in [
        {"messages": [{"role": "user", "content": 5}]},
        {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2**70},
        {"messages": [{"role": "user", "content": "x"}], "seed": 2**70},
        {"messages": [{"role": "user", "content": "x"}], "n": 2**40},
        {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2**40},
        {"prompt": [], "max_tokens": 2},
        {"prompt": "x", "max_tokens": -1},
    ]:
        route = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        response = await http.post(route, json=body, timeout=3)
        assert 400 <= response.status_code < 500, (body, response.text)


async def test_api_key_routes(settings, peer):
    settings = settings.model_copy(update={"api_key": "Secret"})
    good = {"Authorization": "bearer Secret"}  # the scheme in any case, the key exactly
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    with serve(settings) as url:
        async with httpx.AsyncClient(base_url=url, timeout=10) as http:
            for route, body in [
                ("/invocations", {"inputs": "x", "parameters": {"max_new_tokens": 2}}),
                ("/invocations", chat),
                ("/vertex", {"instances": [{"inputs": "x", "parameters": {"max_new_tokens": 2}}]}),
            ]:
                response = await http.post(route, json=body)
                assert response.status_code == 401, route
                assert response.json()["error_type"] == "unauthorized", route
                for wrong in ("Bearer nope", "Bearer SECRET", "Bearer secret", "Secret"):
                    response = await http.post(route, json=body, headers={"Authorization": wrong})
                    assert response.status_code == 401, (route, wrong)
                # refused before the body is read: a malformed body is still a 401
                response = await http.post(route, content=b"{", headers=JSON)
                assert response.status_code == 401, route
                response = await http.post(route, json=body, headers=good)
                assert response.status_code == 200, (route, response.text)
            metrics = (await http.get("/metrics")).text
            assert "textgen_unauthorized_requests 18\n" in metrics  # 3 routes x 6
            # /chat_tokenize shows the template: protected too (TGI left it open)
            response = await http.post("/chat_tokenize", json=chat)
            assert response.status_code == 401 and response.json()["error_type"] == "unauthorized"
            response = await http.post("/chat_tokenize", json=chat, headers=good)
            assert response.status_code == 200, response.text
            # the probes, /info, /metrics, /v1/models and the API documents stay open
            for path in ("/health", "/live", "/info", "/metrics", "/v1/models", "/openapi.json"):
                assert (await http.get(path)).status_code in (200, 503), path


async def test_garbage_on_the_reply_channel(http, peer, redis_url, namespace):
    """Poisoned ReplyBatches are skipped: the gateway's one subscription keeps serving."""
    import msgspec
    import redis.asyncio as aioredis

    from shared.channels import Channels
    from shared.codec import encode
    from shared.messages import ReplyBatch, TokenEvent

    response = await http.post("/generate", json={"inputs": "Hi", "parameters": {}})
    assert response.status_code == 200
    client = aioredis.from_url(redis_url)
    try:
        # the gateway id is random: find its reply channel in Redis
        channels = await client.pubsub_channels(Channels(namespace).reply("*"))
        assert len(channels) == 1
        for data in [
            b"\xc1garbage",
            b"",
            msgspec.msgpack.encode({"events": "x"}),
            msgspec.msgpack.encode({"events": [{"request_id": None}]}),
            encode(ReplyBatch(v=99, events=[TokenEvent(request_id="x", token_ids=[1])])),
        ]:
            assert await client.publish(channels[0], data) == 1
        for _ in range(2):
            response = await http.post(
                "/generate", json={"inputs": "Hi", "parameters": {"max_new_tokens": 3}}
            )
            assert response.status_code == 200, response.text
    finally:
        await client.aclose()

"""The TGI compatibility checklist (../shared/reference/tgi-api.md §15, items 1-22 and 31-35)
against the real stack over HTTP. Items 1-6 and 20 also live in test_pipeline.py."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import openai
import pytest
import text_generation
import torch

from tests.e2e.test_pipeline import prompt_text, sse_events
from tests.support.reference import greedy_ids, reference_model, tokenizer

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def url(tiny_cluster) -> str:
    return tiny_cluster.gateway_urls[0]


def post(url: str, path: str, body: dict, **kwargs) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=60, **kwargs)


def test_07_top_n_tokens(url, tiny_llama):
    response = post(url, "/generate", {"inputs": "Hi", "parameters": {"top_n_tokens": 6}})
    assert response.status_code == 422
    assert response.json()["error"] == (
        "Input validation error: `top_n_tokens` must be >= 0 and <= 5. Given: 6"
    )
    prompt = prompt_text(3, 5)
    body = post(
        url,
        "/generate",
        {"inputs": prompt, "parameters": {"top_n_tokens": 2, "max_new_tokens": 4, "details": True}},
    ).json()
    tokens, tops = body["details"]["tokens"], body["details"]["top_tokens"]
    assert len(tops) == len(tokens) == 4
    assert all(len(top) == 2 and top[0]["id"] == tok["id"] for top, tok in zip(tops, tokens))
    # the first step's alternatives are transformers' top-2 of the prompt's last position
    input_ids = tokenizer(tiny_llama)(prompt).input_ids
    with torch.inference_mode():
        logprobs = reference_model(tiny_llama)(torch.tensor([input_ids])).logits[0, -1]
    values, ids = torch.topk(logprobs.log_softmax(-1), 2)
    assert [t["id"] for t in tops[0]] == ids.tolist()
    assert [t["logprob"] for t in tops[0]] == pytest.approx(values.tolist(), abs=1e-4)
    # one id, one text: the greedy token and its own entry among the alternatives agree,
    # leading space included (the text each continues the prompt with)
    hf = tokenizer(tiny_llama)
    prefix = hf.decode(input_ids, skip_special_tokens=True)
    for i in ids.tolist():
        text = hf.decode(input_ids + [i], skip_special_tokens=True)[len(prefix) :]
        assert next(t["text"] for t in tops[0] if t["id"] == i) == text
    assert all(top[0]["text"] == tok["text"] or tok["text"] == "" for top, tok in zip(tops, tokens))
    # the text-generation client reads the same texts
    details = text_generation.Client(url).generate(prompt, max_new_tokens=4, top_n_tokens=2).details
    assert [[t.text for t in top] for top in details.top_tokens] == [
        [t["text"] for t in top] for top in tops
    ]


def test_08_body_decoding_errors(url):
    for body in ({"inputs": "Hi", "parameters": {"max_new_tokens": -1}}, {"parameters": {}}):
        response = post(url, "/generate", body)
        assert response.status_code == 422
        assert response.text.startswith("Failed to deserialize the JSON body into the target type")
        with pytest.raises(json.JSONDecodeError):
            json.loads(response.text)
    malformed = httpx.post(
        f"{url}/generate", content=b"{not json", headers={"Content-Type": "application/json"}
    )
    assert malformed.status_code == 400
    assert malformed.text.startswith("Failed to parse the request body as JSON")
    no_type = httpx.post(f"{url}/generate", content=b'{"inputs": "Hi"}')
    assert no_type.status_code == 415
    assert no_type.text == "Expected request with `Content-Type: application/json`"


def test_09_10_11_16_details_lengths_and_headers(url, tiny_llama):
    plain = post(url, "/generate", {"inputs": "Hi", "parameters": {"max_new_tokens": 3}})
    assert list(plain.json()) == ["generated_text"]
    # a prompt whose greedy continuation has no EOS in its first 7 tokens
    prompt = next(
        p
        for p in (prompt_text(i, 6) for i in range(20))
        if 2 not in greedy_ids(tiny_llama, p, 7, [2])
    )
    response = post(
        url, "/generate", {"inputs": prompt, "parameters": {"max_new_tokens": 7, "details": True}}
    )
    details = response.json()["details"]
    assert details["finish_reason"] == "length"
    assert details["generated_tokens"] == len(details["tokens"]) == 7
    assert details["seed"] is None and details["prefill"] == []
    headers = response.headers
    assert headers["x-generated-tokens"] == "7"
    assert headers["x-prompt-tokens"] == str(len(tokenizer(tiny_llama)(prompt).input_ids))
    for name in (
        "x-compute-type",
        "x-compute-characters",
        "x-total-time",
        "x-validation-time",
        "x-queue-time",
        "x-inference-time",
        "x-time-per-token",
    ):
        assert name in headers, name
    assert float(headers["x-compute-time"]) > 0
    assert headers["x-compute-characters"] == str(len(prompt))
    sampled = post(
        url,
        "/generate",
        {"inputs": prompt, "parameters": {"do_sample": True, "max_new_tokens": 3, "details": True}},
    ).json()["details"]
    assert isinstance(sampled["seed"], int)


def test_13_seed_reproducible_alone_and_in_a_busy_batch_and_no_parameters_samples(url):
    body = {
        "inputs": "the cat",
        "parameters": {
            "do_sample": True,
            "seed": 1234,
            "max_new_tokens": 20,
            "top_k": 50,
            "temperature": 0.9,
        },
    }
    alone = post(url, "/generate", body).json()["generated_text"]
    assert post(url, "/generate", body).json()["generated_text"] == alone

    async def busy():
        async with httpx.AsyncClient(timeout=60) as client:
            noise = [
                client.post(
                    f"{url}/generate",
                    json={
                        "inputs": prompt_text(i, 3 + i * 9),
                        "parameters": {"max_new_tokens": 30},
                    },
                )
                for i in range(8)
            ]
            tasks = [asyncio.ensure_future(n) for n in noise]
            await asyncio.sleep(0.2)
            seeded = await client.post(f"{url}/generate", json=body)
            await asyncio.gather(*tasks)
            return seeded.json()["generated_text"]

    assert asyncio.run(busy()) == alone
    unparametrized = post(url, "/generate", {"inputs": "the cat"}).json()
    assert "details" not in unparametrized
    details = post(
        url, "/", {"inputs": "the cat", "parameters": {"details": True, "do_sample": True}}
    )
    assert isinstance(details.json()[0]["details"]["seed"], int)


def test_14_return_full_text_and_compat_route(url):
    body = {"inputs": "the cat", "parameters": {"max_new_tokens": 3, "return_full_text": True}}
    assert post(url, "/generate", body).json()["generated_text"].startswith("the cat")
    compat = post(url, "/", {"inputs": "the cat", "parameters": {"max_new_tokens": 3}})
    assert isinstance(compat.json(), list) and len(compat.json()) == 1
    assert compat.json()[0]["generated_text"].startswith("the cat")  # true by default on `/`


def test_15_best_of(url):
    body = {
        "inputs": "the cat",
        "parameters": {"best_of": 2, "do_sample": True, "details": True, "max_new_tokens": 5},
    }
    details = post(url, "/generate", body).json()["details"]
    assert len(details["best_of_sequences"]) == 1
    with_seed = post(
        url,
        "/generate",
        {"inputs": "Hi", "parameters": {"best_of": 2, "do_sample": True, "seed": 1}},
    )
    assert with_seed.status_code == 422
    assert with_seed.json()["error"].endswith("`seed` must not be set when `best_of` > 1")
    three = post(
        url, "/generate", {"inputs": "Hi", "parameters": {"best_of": 3, "do_sample": True}}
    )
    assert three.status_code == 422
    assert three.json()["error"].endswith("`best_of` must be > 0 and <= 2. Given: 3")


def test_17_19_stream_shape_and_in_stream_errors(url):
    body = {"inputs": "the cat", "parameters": {"max_new_tokens": 6, "details": True}}
    stream = post(url, "/generate_stream", body)
    assert "[DONE]" not in stream.text
    assert re.match(r"data: \{", stream.text)
    final = sse_events(stream.text)[-1]
    prompt_tokens = post(url, "/generate", body).headers["x-prompt-tokens"]
    assert final["details"]["input_length"] == int(prompt_tokens)
    for parameters, message in (
        ({"best_of": 2, "do_sample": True}, "`best_of` != 1 is not supported when streaming"),
        ({"decoder_input_details": True}, "`decoder_input_details` == true is not supported"),
    ):
        response = post(url, "/generate_stream", {"inputs": "Hi", "parameters": parameters})
        assert response.status_code == 200
        (event,) = sse_events(response.text)
        assert event["error_type"] == "validation" and message in event["error"]


def test_decoder_input_details_match_transformers_log_softmax(url, tiny_llama):
    prompt = prompt_text(6, 30)
    body = post(
        url,
        "/generate",
        {"inputs": prompt, "parameters": {"max_new_tokens": 2, "decoder_input_details": True}},
    ).json()
    prefill = body["details"]["prefill"]
    input_ids = tokenizer(tiny_llama)(prompt).input_ids
    assert [p["id"] for p in prefill] == input_ids
    assert prefill[0]["logprob"] is None
    with torch.inference_mode():
        logits = reference_model(tiny_llama)(torch.tensor([input_ids])).logits[0]
    expected = logits[:-1].log_softmax(-1).gather(1, torch.tensor(input_ids[1:])[:, None])[:, 0]
    assert [p["logprob"] for p in prefill[1:]] == pytest.approx(expected.tolist(), abs=1e-4)


def test_21_22_overload_and_disconnect_release(tiny_cluster):
    url = tiny_cluster.add_gateway("--max-concurrent-requests", "1")
    long = {"inputs": "the cat", "parameters": {"max_new_tokens": 480}}

    async def scenario():
        # the others go while the first streams (a fixed sleep for it to start used up 300
        # tokens' time on a fast host: the first had ended and the second got a 200)
        async with httpx.AsyncClient(timeout=60) as client:
            async with client.stream("POST", f"{url}/generate_stream", json=long) as first:
                lines = first.aiter_lines()
                async for line in lines:
                    if line.startswith("data:"):
                        break
                second = await client.post(f"{url}/generate", json={"inputs": "Hi"})
                stream = await client.post(f"{url}/generate_stream", json={"inputs": "Hi"})
                async for _ in lines:
                    pass
            return second, stream

    second, stream = asyncio.run(scenario())
    assert second.status_code == 429
    assert second.json() == {"error": "Model is overloaded", "error_type": "overloaded"}
    assert stream.status_code == 200
    assert sse_events(stream.text)[0]["error_type"] == "overloaded"

    def dropped() -> float:
        text = httpx.get(f"{url}/metrics").text
        match = re.search(r'^tgi_request_failure\{err="dropped"\} (\S+)$', text, re.M)
        return float(match.group(1)) if match else 0.0

    before = dropped()
    complete = post(url, "/generate_stream", {"inputs": "Hi", "parameters": {"max_new_tokens": 3}})
    assert len(sse_events(complete.text)) == 3
    assert dropped() == before, "a stream read to its end is not a dropped request"
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", f"{url}/generate_stream", json=long) as response:
            for line in response.iter_lines():
                if line.startswith("data:"):
                    break
    ok = post(url, "/generate", {"inputs": "Hi", "parameters": {"max_new_tokens": 2}})
    assert ok.status_code == 200
    assert dropped() == before + 1


def test_31_32_33_34_info_health_tokenize_metrics(url, tiny_llama):
    for path in ("/health", "/"):
        response = httpx.get(f"{url}{path}")
        assert response.status_code == 200 and response.content == b""
    info = httpx.get(f"{url}/info").json()
    for key in (
        "model_id",
        "max_input_tokens",
        "max_total_tokens",
        "max_concurrent_requests",
        "max_best_of",
        "max_stop_sequences",
        "max_client_batch_size",
        "version",
    ):
        assert key in info, key
    assert info["model_id"] == str(tiny_llama) and info["max_total_tokens"] == 512
    # the 2.x fields, from the worker that loaded the model (a float32 checkpoint on CPU)
    assert (info["model_dtype"], info["model_device_type"]) == ("float32", "cpu")
    tokens = post(url, "/tokenize", {"inputs": "Hello world"}).json()
    generated = post(
        url, "/generate", {"inputs": "Hello world", "parameters": {"max_new_tokens": 1}}
    )
    assert len(tokens) == int(generated.headers["x-prompt-tokens"])
    assert [t["id"] for t in tokens] == tokenizer(tiny_llama)("Hello world").input_ids
    metrics = httpx.get(f"{url}/metrics").text
    for name in (
        "tgi_request_count",
        "tgi_request_success",
        "tgi_request_failure",
        "tgi_queue_size",
        "tgi_batch_current_size",
        "tgi_request_duration_bucket",
        "tgi_request_generated_tokens_bucket",
        "tgi_request_input_length_bucket",
    ):
        assert re.search(rf"^{name}[{{ ]", metrics, re.M), name
    assert "tgi_request_count_total" not in metrics


def test_35_api_key(tiny_cluster):
    """The key is compared exactly: TGI's case-insensitive comparison let `BEARER SECRET123`
    in for `Secret123`. The official clients send it as `Bearer <key>`."""
    url = tiny_cluster.add_gateway("--api-key", "Secret123")
    body = {"inputs": "Hi", "parameters": {"max_new_tokens": 2}}
    denied = post(url, "/generate", body)
    assert denied.status_code == 401 and denied.json() == {
        "error": "Unauthorized: missing or wrong API key",
        "error_type": "unauthorized",
    }
    assert denied.headers["www-authenticate"] == "Bearer"
    for wrong in ("Bearer secret123", "BEARER SECRET123", "Bearer Secret1234", "Secret123"):
        assert post(url, "/generate", body, headers={"Authorization": wrong}).status_code == 401
    allowed = post(url, "/generate", body, headers={"Authorization": "Bearer Secret123"})
    assert allowed.status_code == 200
    for path in ("/health", "/info", "/metrics", "/v1/models"):
        assert httpx.get(f"{url}{path}").status_code == 200
    chat = {"messages": [{"role": "user", "content": "Hi"}]}
    assert post(url, "/chat_tokenize", chat).status_code == 401
    # the three official clients, with the key and without it
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="secret123", max_retries=0).completions.create(
            model="tgi", prompt="Hi", max_tokens=2
        )
    sdk = openai.OpenAI(base_url=f"{url}/v1", api_key="Secret123", max_retries=0)
    assert sdk.completions.create(model="tgi", prompt="Hi", max_tokens=2).usage.completion_tokens
    tgi = text_generation.Client(url, headers={"Authorization": "Bearer Secret123"})
    assert tgi.generate("Hi", max_new_tokens=2).generated_text is not None
    with pytest.raises(text_generation.errors.UnknownError, match="missing or wrong API key"):
        text_generation.Client(url).generate("Hi", max_new_tokens=2)  # TGI's empty 401 crashed it

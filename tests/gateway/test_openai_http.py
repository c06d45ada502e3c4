"""The OpenAI routes over real HTTP and Redis with the stand-in worker (tests/gateway/peer.py):
what reaches the worker (prompt ids, sampling) and the exact response shapes, against OpenAI's
API reference: ids, choices, usage, finish reasons, stop text, errors."""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil

import httpx

from services.gateway.pipeline.tokenizer import TextTokenizer
from tests.gateway.peer import CONTINUATION
from tests.support.gateway_server import serve

MESSAGES = [{"role": "user", "content": "Hi"}]
TEMPLATED = "<s>user: Hi\n<s>assistant:"


def openai_events(text: str) -> list[dict]:
    """The JSON events of an OpenAI stream, which must end with `data: [DONE]`."""
    blocks = [b for b in text.split("\n\n") if b.strip()]
    assert all(b.startswith("data: ") for b in blocks), blocks
    assert blocks[-1] == "data: [DONE]"
    return [json.loads(b[len("data: ") :]) for b in blocks[:-1]]


def error_of(response: httpx.Response, status: int) -> dict:
    """The OpenAI error object of a non-stream error response."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    (error,) = response.json().values()
    assert set(error) == {"message", "type", "param", "code"}, error
    return error


def request_count(metrics: str) -> int:
    return next(
        int(line.split()[1])
        for line in metrics.splitlines()
        if line.startswith("tgi_request_count ")
    )


async def test_chat_prompt_sampling_and_shape(http, peer, tokenizer_dir):
    response = await http.post("/v1/chat/completions", json={"messages": MESSAGES, "seed": 3})
    assert response.status_code == 200, response.text
    body = response.json()
    request = peer.requests[-1]
    tokenizer = TextTokenizer.from_folder(tokenizer_dir)
    # the template's <s> is the only BOS: no special tokens are added to the templated prompt
    expected_ids = tokenizer.tokenizer.encode(TEMPLATED, add_special_tokens=False).ids
    assert request.input_ids == expected_ids and request.input_ids[:2] != [1, 1]
    assert request.sampling.do_sample and request.sampling.seed == 3  # sampling by default
    assert request.stopping.max_new_tokens == 64 - len(expected_ids)
    assert body["object"] == "chat.completion"
    assert body["id"].startswith("chatcmpl-") and len(body["id"]) > len("chatcmpl-") + 16
    assert body["model"] == str(tokenizer_dir)
    assert body["system_fingerprint"].endswith("-native")
    (choice,) = body["choices"]
    assert choice["message"] == {"role": "assistant", "content": CONTINUATION}
    assert choice["finish_reason"] == "stop" and choice["logprobs"] is None
    num_generated = len(peer.continuation_ids) + 1  # + EOS
    assert body["usage"] == {
        "prompt_tokens": len(expected_ids),
        "completion_tokens": num_generated,
        "total_tokens": len(expected_ids) + num_generated,
    }
    assert response.headers["x-compute-characters"] == str(len(TEMPLATED))
    assert response.headers["x-prompt-tokens"] == str(len(expected_ids))
    metrics = (await http.get("/metrics")).text
    assert request_count(metrics) == 2  # a chat request counts twice (TGI quirk)
    assert 'textgen_openai_generations_count{route="chat"} 1.0' in metrics
    again = await http.post("/v1/chat/completions", json={"messages": MESSAGES})
    assert again.json()["id"] != body["id"]  # one id per request

    response = await http.post(
        "/v1/chat/completions",
        json={
            "messages": MESSAGES,
            "model": "foo",
            "temperature": 0,
            "top_p": 1,
            "presence_penalty": 0.5,
            "logit_bias": {"5": 3.5, "7": -100},
            "max_tokens": 3,
            "logprobs": True,
            "top_logprobs": 2,
        },
    )
    body = response.json()
    sampling = peer.requests[-1].sampling
    assert not sampling.do_sample and sampling.repetition_penalty == 1.0
    assert sampling.presence_penalty == 0.5 and sampling.top_p == 1.0
    assert sampling.logit_bias == {5: 3.5, 7: -100.0}
    assert sampling.top_n_tokens == 2 and peer.requests[-1].stopping.max_new_tokens == 3
    assert body["model"] == "foo" and body["choices"][0]["finish_reason"] == "length"
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == 3 and all(len(item["top_logprobs"]) == 2 for item in content)
    assert "".join(item["token"] for item in content) == body["choices"][0]["message"]["content"]
    assert all(bytes(item["bytes"]).decode() == item["token"] for item in content)


async def test_chat_n_choices(http, peer):
    response = await http.post(
        "/v1/chat/completions", json={"messages": MESSAGES, "n": 3, "seed": 10, "max_tokens": 4}
    )
    body = response.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert sorted(r.sampling.seed for r in peer.requests[-3:]) == [10, 11, 12]
    prompt_tokens = len(peer.requests[-1].input_ids)
    assert body["usage"] == {  # the prompt once, every choice's tokens
        "prompt_tokens": prompt_tokens,
        "completion_tokens": 12,
        "total_tokens": prompt_tokens + 12,
    }
    response = await http.post(
        "/v1/chat/completions",
        json={"messages": MESSAGES, "n": 2, "max_tokens": 3, "stream": True},
    )
    events = openai_events(response.text)
    assert len({e["id"] for e in events}) == 1 and events[0]["id"].startswith("chatcmpl-")
    # each choice opens with its role, in index order; later deltas carry only content
    assert [e["choices"][0]["index"] for e in events[:2]] == [0, 1]
    assert all(e["choices"][0]["delta"] == {"role": "assistant", "content": ""} for e in events[:2])
    for index in (0, 1):
        mine = [e["choices"][0] for e in events[2:] if e["choices"][0]["index"] == index]
        assert all("role" not in c["delta"] for c in mine)
        assert [c["finish_reason"] for c in mine][-1] == "length"
        assert (
            "".join(c["delta"].get("content", "") for c in mine)
            == body["choices"][0]["message"]["content"][
                : len("".join(c["delta"].get("content", "") for c in mine))
            ]
        )


async def test_chat_stream(http, peer):
    response = await http.post(
        "/v1/chat/completions",
        json={
            "messages": MESSAGES,
            "stream": True,
            "stream_options": {"include_usage": True},
            "logprobs": True,
        },
    )
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    assert response.headers["x-compute-characters"] == str(len(TEMPLATED))
    events = openai_events(response.text)
    opening, *chunks, usage = events
    assert len({e["id"] for e in events}) == 1
    assert all(c["object"] == "chat.completion.chunk" and c["usage"] is None for c in chunks)
    assert opening["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all("role" not in c["choices"][0]["delta"] for c in chunks)
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + [
        "stop"
    ]
    assert chunks[-1]["choices"][0]["delta"] == {}  # EOS shows nothing
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == CONTINUATION
    assert all(len(c["choices"][0]["logprobs"]["content"]) == 1 for c in chunks)
    assert usage["choices"] == [] and usage["object"] == "chat.completion.chunk"
    assert usage["usage"]["completion_tokens"] == len(chunks)
    # without include_usage: no usage chunk, and no chunk has a usage key
    plain = await http.post(
        "/v1/chat/completions", json={"messages": MESSAGES, "stream": True, "max_tokens": 2}
    )
    events = openai_events(plain.text)
    assert len(events) == 3 and events[-1]["choices"][0]["finish_reason"] == "length"
    assert all("usage" not in e for e in events)


async def test_stop_strings_are_not_in_openai_answers(http, peer):
    # CONTINUATION = " the cat sat on the mat. 日本 the dog ran"; the stop spans tokens
    stop = ["sat on", "dog"]
    response = await http.post("/v1/chat/completions", json={"messages": MESSAGES, "stop": stop})
    (choice,) = response.json()["choices"]
    assert choice["message"]["content"] == " the cat " and choice["finish_reason"] == "stop"
    streamed = await http.post(
        "/v1/chat/completions", json={"messages": MESSAGES, "stop": stop, "stream": True}
    )
    chunks = openai_events(streamed.text)[1:]
    deltas = [c["choices"][0]["delta"].get("content", "") for c in chunks]
    assert "".join(deltas) == " the cat " and chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert not any("sat" in delta for delta in deltas)  # never shown, even in part
    completion = await http.post(
        "/v1/completions", json={"prompt": "a", "stop": "mat.", "echo": True, "stream": True}
    )
    chunks = openai_events(completion.text)
    assert "".join(c["choices"][0]["text"] for c in chunks) == "a the cat sat on the "
    # TGI's own routes keep TGI's contract: the stop string ends the text
    tgi = await http.post("/generate", json={"inputs": "a", "parameters": {"stop": ["mat."]}})
    assert tgi.json()["generated_text"] == " the cat sat on the mat."


async def test_chat_errors(http, peer):
    error = error_of(
        await http.post(
            "/v1/chat/completions",
            json={"messages": MESSAGES, "logprobs": True, "top_logprobs": 10},
        ),
        400,
    )
    assert error == {
        "message": "Input validation error: `top_n_tokens` must be >= 0 and <= 5. Given: 10",
        "type": "invalid_request_error",
        "param": "top_logprobs",
        "code": "validation",
    }
    # admission comes before the stream: a bad request is a 400 even when streaming
    error = error_of(
        await http.post(
            "/v1/chat/completions", json={"messages": MESSAGES, "top_p": 1.5, "stream": True}
        ),
        400,
    )
    assert error["param"] == "top_p" and "`top_p` must be > 0.0 and < 1.0" in error["message"]
    tool = {"type": "function", "function": {"name": "f", "parameters": {}}}
    body = {"messages": MESSAGES, "tools": [tool], "response_format": {"type": "json_object"}}
    error = error_of(await http.post("/v1/chat/completions", json={**body, "stream": True}), 400)
    assert error["code"] == "tool_error"
    assert error["message"] == "Tool error: Grammar and tools are mutually exclusive"
    error = error_of(
        await http.post(
            "/v1/chat/completions",
            json={"messages": MESSAGES, "response_format": {"type": "json", "value": "{bad"}},
        ),
        400,
    )
    assert error["message"].startswith("Input validation error: grammar is not valid: ")
    assert error["param"] == "response_format"
    error = error_of(
        await http.post("/v1/chat/completions", json={"messages": [{"role": "user"}]}), 400
    )
    assert error["message"].startswith("Failed to deserialize") and error["param"] == "messages"
    error = error_of(
        await http.post(
            "/v1/chat/completions",
            content=b'{"messages": []}',
            headers={"content-type": "text/plain"},
        ),
        415,
    )
    assert error["code"] == "unsupported_media_type"
    error = error_of(
        await http.post(
            "/v1/chat/completions",
            content=b'{"messages": [',
            headers={"content-type": "application/json"},
        ),
        400,
    )
    assert error["code"] == "invalid_json"
    error = error_of(
        await http.post("/v1/chat/completions", json={"messages": MESSAGES, "logit_bias": [1.0]}),
        400,
    )
    assert error["param"] == "logit_bias"
    failed = await http.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "FAIL"}], "stream": True},
    )
    assert failed.status_code == 200  # the failure came after the stream started
    opening, event = openai_events(failed.text)
    assert opening["choices"][0]["delta"]["role"] == "assistant"
    assert event["error"]["type"] == "server_error" and event["error"]["code"] == "generation"
    assert "worker exploded" in event["error"]["message"]
    metrics = (await http.get("/metrics")).text
    # top_logprobs, top_p, response_format, logit_bias (shape errors come before counting)
    assert 'tgi_request_failure{err="validation"} 4' in metrics
    assert 'tgi_request_failure{err="tool_error"} 1' in metrics
    assert 'tgi_request_failure{err="generation"} 1' in metrics


async def test_chat_without_template_is_template_error(settings, tmp_path, tokenizer_dir, peer):
    folder = tmp_path / "no-template"
    shutil.copytree(tokenizer_dir, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    with serve(settings.model_copy(update={"model_id": str(folder)})) as url:
        async with httpx.AsyncClient(base_url=url, timeout=10) as http:
            for stream in (False, True):
                response = await http.post(
                    "/v1/chat/completions", json={"messages": MESSAGES, "stream": stream}
                )
                error = error_of(response, 400)
                assert error["message"] == "Template error: template not found"
                assert error["code"] == "template_error"
            metrics = (await http.get("/metrics")).text
            assert 'tgi_request_failure{err="template"} 2' in metrics


async def test_completions(http, peer, tokenizer_dir):
    before = (await http.get("/metrics")).text
    response = await http.post(
        "/v1/completions", json={"prompt": ["once", "upon a"], "max_tokens": 3, "model": "x"}
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "text_completion" and body["model"] == str(tokenizer_dir)
    assert body["id"].startswith("cmpl-")
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert all(c["finish_reason"] == "length" and c["logprobs"] is None for c in body["choices"])
    prompt_ids = [r.input_ids for r in peer.requests[-2:]]
    assert all(ids[0] == 1 for ids in prompt_ids)  # BOS added for completions
    assert body["usage"] == {
        "prompt_tokens": sum(len(ids) for ids in prompt_ids),
        "completion_tokens": 6,
        "total_tokens": sum(len(ids) for ids in prompt_ids) + 6,
    }
    assert response.headers["x-generated-tokens"] == "6"
    assert "x-compute-time" not in response.headers
    after = (await http.get("/metrics")).text
    assert request_count(after) - request_count(before) == 3  # request + each prompt (quirk)

    response = await http.post(
        "/v1/completions",
        json={
            "prompt": ["once", "upon a"],
            "max_tokens": 3,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    *events, usage = openai_events(response.text)
    assert len({e["id"] for e in events}) == 1 and usage["id"] == events[0]["id"]
    by_index = {0: [], 1: []}
    for event in events:
        (choice,) = event["choices"]
        by_index[choice["index"]].append(event)
        assert event["usage"] is None
    for chunks in by_index.values():
        assert len(chunks) == 3
        assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert "".join(c["choices"][0]["text"] for c in chunks) == body["choices"][0]["text"]
    assert usage["choices"] == [] and usage["usage"] == body["usage"]
    unasked = await http.post("/v1/completions", json={"prompt": "a", "stream": True})
    assert all("usage" not in e for e in openai_events(unasked.text))


async def test_completions_n_best_of_logprobs_and_echo(http, peer):
    response = await http.post(
        "/v1/completions",
        json={"prompt": ["a", "b"], "n": 2, "max_tokens": 2, "logprobs": 1, "seed": 5},
    )
    body = response.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]  # prompt by prompt
    for choice in body["choices"]:
        logprobs = choice["logprobs"]
        assert "".join(logprobs["tokens"]) == choice["text"]
        assert logprobs["text_offset"][0] == 0 and len(logprobs["token_logprobs"]) == 2
        assert all(len(top) == 1 for top in logprobs["top_logprobs"])  # the stand-in's top 1
    assert body["usage"]["completion_tokens"] == 8
    best = await http.post(
        "/v1/completions", json={"prompt": "a", "n": 1, "best_of": 3, "max_tokens": 2}
    )
    assert len(best.json()["choices"]) == 1 and best.json()["usage"]["completion_tokens"] == 6
    echoed = await http.post(
        "/v1/completions", json={"prompt": "once", "echo": True, "max_tokens": 2}
    )
    assert echoed.json()["choices"][0]["text"].startswith("once the")
    error = error_of(
        await http.post("/v1/completions", json={"prompt": "a", "echo": True, "logprobs": 1}),
        400,
    )
    assert error["param"] == "echo"
    error = error_of(await http.post("/v1/completions", json={"prompt": "a", "best_of": 30}), 400)
    assert error["param"] == "best_of"


async def test_completion_errors(http, peer):
    error = error_of(await http.post("/v1/completions", json={"prompt": "a", "suffix": "b"}), 400)
    assert error["message"] == (
        "Suffix is not supported and can be achieved by preprocessing the prompt."
    )
    assert error["code"] == "suffix not supported" and error["param"] == "suffix"
    error = error_of(await http.post("/v1/completions", json={"prompt": ["a"] * 5}), 400)
    assert error["message"] == "Number of prompts exceeds the maximum allowed batch size of 4"
    error = error_of(await http.post("/v1/completions", json={"prompt": ["a", "FAIL"]}), 500)
    assert "worker exploded" in error["message"] and error["type"] == "server_error"
    error = error_of(
        await http.post("/v1/completions", json={"prompt": ["a", ""], "stream": True}), 400
    )
    assert error["message"] == "Input validation error: `inputs` cannot be empty"
    assert error["param"] == "prompt"
    error = error_of(await http.post("/v1/completions", json={"prompt": []}), 400)
    assert error["message"].startswith("Failed to deserialize") and error["param"] == "prompt"


async def test_models_api_key_and_overload(settings, peer):
    settings = settings.model_copy(update={"api_key": "Secret123", "max_concurrent_requests": 1})
    with serve(settings) as url:
        async with httpx.AsyncClient(base_url=url, timeout=10) as http:
            models = await http.get("/v1/models")
            assert models.status_code == 200
            assert models.json() == {
                "object": "list",
                "data": [
                    {
                        "id": settings.model_id,
                        "object": "model",
                        "created": 0,
                        "owned_by": settings.model_id,
                    }
                ],
            }
            for path, body in (
                ("/v1/chat/completions", {"messages": MESSAGES}),
                ("/v1/completions", {"prompt": "a"}),
            ):
                for key in (None, "Bearer secret123", "BEARER SECRET123", "Secret123"):
                    headers = {"Authorization": key} if key else {}
                    response = await http.post(path, json=body, headers=headers)
                    assert error_of(response, 401)["type"] == "authentication_error"
                    assert response.headers["www-authenticate"] == "Bearer"
            metrics = (await http.get("/metrics")).text
            assert "textgen_unauthorized_requests 8\n" in metrics  # 2 routes x 4
            auth = {"Authorization": "bearer Secret123"}  # the scheme in any case
            slow = asyncio.create_task(
                http.post(
                    "/v1/completions",
                    headers=auth,
                    json={"prompt": "SLOW", "max_tokens": 10},
                )
            )
            await asyncio.sleep(0.3)
            response = await http.post(
                "/v1/chat/completions", headers=auth, json={"messages": MESSAGES}
            )
            assert error_of(response, 429)["code"] == "overloaded"
            response = await http.post(
                "/v1/chat/completions", headers=auth, json={"messages": MESSAGES, "stream": True}
            )
            assert error_of(response, 429)["type"] == "rate_limit_error"
            response = await http.post(
                "/v1/completions", headers=auth, json={"prompt": "a", "n": 2}
            )
            assert response.status_code == 429  # both choices' slots or none
            slow.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await slow
            await asyncio.sleep(0.3)
            response = await http.post(
                "/v1/completions", headers=auth, json={"prompt": "a", "max_tokens": 2}
            )
            assert response.status_code == 200  # the slot came back


async def test_a_stream_cut_before_its_first_byte_gives_its_slots_back(settings, peer):
    settings = settings.model_copy(update={"max_concurrent_requests": 2})
    with serve(settings) as url:
        async with httpx.AsyncClient(base_url=url, timeout=10) as http:
            for _ in range(3):
                with contextlib.suppress(httpx.TimeoutException):
                    await http.post(
                        "/v1/completions",
                        json={"prompt": "SILENT", "n": 2, "stream": True},
                        timeout=0.3,
                    )
            await asyncio.sleep(0.3)
            response = await http.post("/v1/completions", json={"prompt": "a", "n": 2})
            assert response.status_code == 200, response.text

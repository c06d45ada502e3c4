"""The OpenAI routes over real HTTP and Redis with the stand-in worker (tests/gateway/peer.py):
what reaches the worker (prompt ids, sampling) and the exact response shapes."""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil

import httpx

from services.gateway.tokenizer import TextTokenizer
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
    assert body["object"] == "chat.completion" and body["id"] == ""
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

    response = await http.post(
        "/v1/chat/completions",
        json={
            "messages": MESSAGES,
            "model": "foo",
            "temperature": 0,
            "presence_penalty": 0.5,
            "max_tokens": 3,
            "logprobs": True,
            "top_logprobs": 2,
        },
    )
    body = response.json()
    request = peer.requests[-1]
    assert not request.sampling.do_sample and request.sampling.repetition_penalty == 2.5
    assert request.sampling.top_n_tokens == 2 and request.stopping.max_new_tokens == 3
    assert body["model"] == "foo" and body["choices"][0]["finish_reason"] == "length"
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == 3 and all(len(item["top_logprobs"]) == 2 for item in content)
    assert "".join(item["token"] for item in content) == body["choices"][0]["message"]["content"]


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
    *chunks, usage = events
    assert all(c["object"] == "chat.completion.chunk" and c["usage"] is None for c in chunks)
    assert all(c["choices"][0]["delta"]["role"] == "assistant" for c in chunks)
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + [
        "stop"
    ]
    assert chunks[-1]["choices"][0]["delta"]["content"] == ""  # EOS shows as ""
    assert "".join(c["choices"][0]["delta"]["content"] for c in chunks) == CONTINUATION
    assert all(len(c["choices"][0]["logprobs"]["content"]) == 1 for c in chunks)
    assert usage["choices"] == [] and usage["object"] == "chat.completion.chunk"
    assert usage["usage"]["completion_tokens"] == len(chunks)
    # without include_usage there is no usage chunk
    plain = await http.post(
        "/v1/chat/completions", json={"messages": MESSAGES, "stream": True, "max_tokens": 2}
    )
    events = openai_events(plain.text)
    assert len(events) == 2 and events[-1]["choices"][0]["finish_reason"] == "length"


async def test_chat_errors(http, peer):
    response = await http.post(
        "/v1/chat/completions", json={"messages": MESSAGES, "logprobs": True, "top_logprobs": 10}
    )
    assert response.status_code == 422
    assert response.json() == {
        "error": "Input validation error: `top_n_tokens` must be >= 0 and <= 5. Given: 10",
        "error_type": "validation",
    }
    response = await http.post(
        "/v1/chat/completions", json={"messages": MESSAGES, "top_p": 1.0, "stream": True}
    )
    assert response.status_code == 200
    (event,) = openai_events(response.text)
    assert event == {
        "error": {
            "message": "Input validation error: `top_p` must be > 0.0 and < 1.0",
            "http_status_code": 422,
        }
    }
    tool = {"type": "function", "function": {"name": "f", "parameters": {}}}
    response = await http.post(
        "/v1/chat/completions", json={"messages": MESSAGES, "tools": [tool], "stream": True}
    )
    assert response.status_code == 422 and response.json()["error_type"] == "tool_error"
    response = await http.post(
        "/v1/chat/completions",
        json={"messages": MESSAGES, "response_format": {"type": "json", "value": {}}},
    )
    assert response.json() == {
        "error": "Input validation error: grammar is not supported",
        "error_type": "validation",
    }
    response = await http.post("/v1/chat/completions", json={"messages": [{"role": "user"}]})
    assert response.status_code == 422 and response.text.startswith("Failed to deserialize")
    response = await http.post(
        "/v1/chat/completions", content=b'{"messages": []}', headers={"content-type": "text/plain"}
    )
    assert response.status_code == 415
    failed = await http.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "FAIL"}], "stream": True},
    )
    (event,) = openai_events(failed.text)
    assert "worker exploded" in event["error"]["message"]
    assert event["error"]["http_status_code"] == 422
    metrics = (await http.get("/metrics")).text
    assert 'tgi_request_failure{err="validation"} 3' in metrics
    assert 'tgi_request_failure{err="tool_error"} 1' in metrics


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
                assert response.status_code == 422
                assert response.json() == {
                    "error": "Template error: template not found",
                    "error_type": "template_error",
                }
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
        "/v1/completions", json={"prompt": ["once", "upon a"], "max_tokens": 3, "stream": True}
    )
    events = openai_events(response.text)
    by_index = {0: [], 1: []}
    for event in events:
        (choice,) = event["choices"]
        by_index[choice["index"]].append(event)
    for chunks in by_index.values():
        assert len(chunks) == 3
        assert all(c["choices"][0]["finish_reason"] == "" and "usage" not in c for c in chunks[:-1])
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert chunks[-1]["usage"]["completion_tokens"] == 3
        assert "".join(c["choices"][0]["text"] for c in chunks) == body["choices"][0]["text"]


async def test_completion_errors(http, peer):
    response = await http.post("/v1/completions", json={"prompt": "a", "suffix": "b"})
    assert response.status_code == 422
    assert response.json() == {
        "error": "Suffix is not supported and can be achieved by preprocessing the prompt.",
        "error_type": "suffix not supported",
    }
    response = await http.post("/v1/completions", json={"prompt": ["a"] * 5})
    assert response.status_code == 422
    assert response.json() == {
        "error": "Number of prompts exceeds the maximum allowed batch size of 4",
        "error_type": "batch size exceeded",
    }
    response = await http.post("/v1/completions", json={"prompt": ["a", "FAIL"]})
    assert response.status_code == 424 and "worker exploded" in response.json()["error"]
    response = await http.post("/v1/completions", json={"prompt": ["a", ""], "stream": True})
    events = openai_events(response.text)
    assert events[-1]["error"]["message"] == "Input validation error: `inputs` cannot be empty"
    response = await http.post("/v1/completions", json={"prompt": []})
    assert response.status_code == 422 and response.text.startswith("Failed to deserialize")


async def test_models_api_key_and_overload(settings, peer):
    settings = settings.model_copy(update={"api_key": "K", "max_concurrent_requests": 1})
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
                response = await http.post(path, json=body)
                assert response.status_code == 401 and response.content == b""
            auth = {"Authorization": "Bearer k"}
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
            assert response.status_code == 429
            response = await http.post(
                "/v1/chat/completions", headers=auth, json={"messages": MESSAGES, "stream": True}
            )
            (event,) = openai_events(response.text)
            assert event["error"] == {"message": "Model is overloaded", "http_status_code": 422}
            slow.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await slow
            await asyncio.sleep(0.3)
            response = await http.post(
                "/v1/completions", headers=auth, json={"prompt": "a", "max_tokens": 2}
            )
            assert response.status_code == 200  # the slot came back

"""The OpenAI-compatible routes against the real stack, driven by the real clients (the `openai`
SDK and `huggingface_hub.InferenceClient`) and by plain HTTP for the TGI checklist items 3
(chat side), 23-27, 30 and 32 (../shared/reference/tgi-api.md §15). Greedy outputs are compared
with transformers' generate on the same templated prompt (tokenized without special tokens)."""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import httpx
import openai
import pytest
import torch
from huggingface_hub import InferenceClient

from shared.model_files import eos_token_ids
from tests.e2e.test_pipeline import prompt_text
from tests.support.reference import greedy_ids, reference_model, tokenizer

pytestmark = pytest.mark.integration
EOS = 2  # tiny_llama's


@pytest.fixture(scope="module")
def url(tiny_cluster) -> str:
    return tiny_cluster.gateway_urls[0]


@pytest.fixture(scope="module")
def stories_url(stories_cluster) -> str:
    return stories_cluster.gateway_urls[0]


@pytest.fixture(scope="module")
def sdk(url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60)


def messages_for(i: int, num_words: int = 4) -> list[dict]:
    return [{"role": "user", "content": prompt_text(i, num_words)}]


def templated_ids(folder: Path, messages: list[dict]) -> list[int]:
    hf = tokenizer(folder)
    prompt = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return hf(prompt, add_special_tokens=False).input_ids


@lru_cache(maxsize=64)
def _chat_reference(folder: Path, content: str, max_new_tokens: int) -> tuple[int, ...]:
    input_ids = templated_ids(folder, [{"role": "user", "content": content}])
    with torch.inference_mode():
        out = reference_model(folder).generate(
            torch.tensor([input_ids]),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=[EOS],
            pad_token_id=0,
        )
    return tuple(out[0, len(input_ids) :].tolist())


def chat_reference(folder: Path, messages: list[dict], max_new_tokens: int) -> list[int]:
    """transformers' greedy ids for a one-user-message chat."""
    return list(_chat_reference(folder, messages[0]["content"], max_new_tokens))


def reference_text(folder: Path, ids: list[int], prompt_ids: list[int] | None = None) -> str:
    """The decoded continuation; with the prompt as context (SentencePiece drops a leading
    space when a text is decoded alone, the server decodes in context)."""
    hf = tokenizer(folder)
    if not prompt_ids:
        return hf.decode(ids, skip_special_tokens=True)
    prefix = hf.decode(prompt_ids, skip_special_tokens=True)
    return hf.decode(prompt_ids + ids, skip_special_tokens=True)[len(prefix) :]


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=60)


def openai_events(response: httpx.Response) -> list[dict]:
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    blocks = [b for b in response.text.split("\n\n") if b.strip()]
    assert all(b.startswith("data: ") for b in blocks), blocks
    assert blocks[-1] == "data: [DONE]"
    return [json.loads(b[len("data: ") :]) for b in blocks[:-1]]


# --- the openai SDK ---------------------------------------------------------------------------


def test_sdk_chat_greedy_equals_transformers_and_stream_matches(sdk, tiny_llama):
    messages = messages_for(1)
    expected = chat_reference(tiny_llama, messages, 12)
    answer = sdk.chat.completions.create(
        model="tgi", messages=messages, temperature=0, max_tokens=12
    )
    (choice,) = answer.choices
    assert choice.message.role == "assistant"
    assert choice.message.content == reference_text(tiny_llama, expected)
    assert choice.finish_reason == ("stop" if EOS in expected else "length")
    prompt_ids = templated_ids(tiny_llama, messages)
    assert answer.usage.prompt_tokens == len(prompt_ids)
    assert answer.usage.completion_tokens == len(expected)
    assert answer.model == str(tiny_llama)

    chunks = list(
        sdk.chat.completions.create(
            model="tgi",
            messages=messages,
            temperature=0,
            max_tokens=12,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    *token_chunks, usage_chunk = chunks
    assert usage_chunk.choices == [] and usage_chunk.usage.total_tokens == answer.usage.total_tokens
    assert all(c.usage is None for c in token_chunks)
    content = "".join(c.choices[0].delta.content or "" for c in token_chunks)
    assert content == choice.message.content
    assert token_chunks[-1].choices[0].finish_reason == choice.finish_reason


def test_sdk_logprobs_match_transformers(sdk, tiny_llama):
    messages = messages_for(2)
    answer = sdk.chat.completions.create(
        model="tgi", messages=messages, temperature=0, max_tokens=4, logprobs=True, top_logprobs=2
    )
    content = answer.choices[0].logprobs.content
    assert len(content) == answer.usage.completion_tokens
    assert all(len(item.top_logprobs) == 2 for item in content)
    prompt_ids = templated_ids(tiny_llama, messages)
    with torch.inference_mode():
        logits = reference_model(tiny_llama)(torch.tensor([prompt_ids])).logits[0, -1]
    values, ids = torch.topk(logits.log_softmax(-1), 2)
    hf = tokenizer(tiny_llama)
    first = content[0]
    assert [top.token for top in first.top_logprobs] == [hf.decode([i]) for i in ids.tolist()]
    assert [top.logprob for top in first.top_logprobs] == pytest.approx(values.tolist(), abs=1e-4)
    assert first.logprob == pytest.approx(values[0].item(), abs=1e-4)  # greedy took the top one


def test_sdk_completions_equal_transformers(stories_url, stories_model):
    client = openai.OpenAI(base_url=f"{stories_url}/v1", api_key="x", max_retries=0, timeout=60)
    prompts = ["Once upon a time", "The little dog"]
    eos = eos_token_ids(stories_model)
    prompt_ids = [tokenizer(stories_model)(p).input_ids for p in prompts]  # BOS added
    expected = [greedy_ids(stories_model, p, 10, eos) for p in prompts]
    texts = [reference_text(stories_model, e, ids) for e, ids in zip(expected, prompt_ids)]
    single = client.completions.create(model="tgi", prompt=prompts[0], max_tokens=10, temperature=0)
    assert single.choices[0].text == texts[0]
    assert single.model == str(stories_model)
    both = client.completions.create(model="tgi", prompt=prompts, max_tokens=10, temperature=0)
    assert [c.index for c in both.choices] == [0, 1]
    assert [c.text for c in both.choices] == texts
    assert both.usage.prompt_tokens == sum(len(ids) for ids in prompt_ids)
    assert both.usage.completion_tokens == sum(len(e) for e in expected)
    assert both.usage.total_tokens == both.usage.prompt_tokens + both.usage.completion_tokens


def test_sdk_surfaces_errors(sdk):
    with pytest.raises(openai.UnprocessableEntityError):
        sdk.chat.completions.create(model="tgi", messages=messages_for(1), top_p=1.0)
    with pytest.raises(openai.APIError, match="must be > 0.0 and < 1.0"):
        list(
            sdk.chat.completions.create(
                model="tgi", messages=messages_for(1), top_p=1.0, stream=True
            )
        )


# --- huggingface_hub.InferenceClient ----------------------------------------------------------


@pytest.fixture
def online(monkeypatch):
    """The suite runs with HF_HUB_OFFLINE=1, which also blocks InferenceClient's HTTP calls."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)


def test_inference_client_text_generation(url, tiny_llama, online):
    client = InferenceClient(base_url=url)
    prompt = prompt_text(4, 6)
    expected = greedy_ids(tiny_llama, prompt, 6, [EOS])
    output = client.text_generation(prompt, max_new_tokens=6, details=True)
    assert [t.id for t in output.details.tokens] == expected
    assert output.details.finish_reason == ("eos_token" if EOS in expected else "length")
    # InferenceClient posts to POST /, where return_full_text defaults to true (TGI quirk)
    assert output.generated_text == prompt + reference_text(tiny_llama, expected)
    events = list(client.text_generation(prompt, max_new_tokens=6, details=True, stream=True))
    assert [e.token.id for e in events] == expected
    assert events[-1].details.finish_reason == output.details.finish_reason
    assert events[-1].generated_text == output.generated_text


def test_inference_client_chat_completion(url, tiny_llama, online):
    client = InferenceClient(base_url=url)
    messages = messages_for(3)
    expected = reference_text(tiny_llama, chat_reference(tiny_llama, messages, 8))
    output = client.chat_completion(messages, max_tokens=8, temperature=0)
    assert output.choices[0].message.content == expected
    assert output.usage.total_tokens == output.usage.prompt_tokens + output.usage.completion_tokens
    chunks = list(client.chat_completion(messages, max_tokens=8, temperature=0, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected


# --- checklist items over HTTP ----------------------------------------------------------------


def test_03_23_chat_non_stream(url, tiny_llama):
    # an EOS within 30 tokens -> "stop"; a stop string -> "stop_sequence" (TGI quirk)
    messages = next(
        m
        for m in (messages_for(i, n) for n in (5, 4, 6) for i in range(40))
        if EOS in chat_reference(tiny_llama, m, 30)
    )
    expected = chat_reference(tiny_llama, messages, 30)
    body = post(
        url, "/v1/chat/completions", {"messages": messages, "temperature": 0, "max_tokens": 30}
    ).json()
    assert body["object"] == "chat.completion" and body["id"] == ""
    assert isinstance(body["created"], int) and body["system_fingerprint"].endswith("-native")
    (choice,) = body["choices"]
    assert choice["message"] == {
        "role": "assistant",
        "content": reference_text(tiny_llama, expected),
    }
    assert choice["finish_reason"] == "stop" and choice["logprobs"] is None
    usage = body["usage"]
    assert usage["completion_tokens"] == len(expected)
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]

    long = chat_reference(tiny_llama, messages_for(1), 12)
    hf = tokenizer(tiny_llama)
    stop = hf.decode(long[3:5])  # a piece of the greedy text
    body = post(
        url,
        "/v1/chat/completions",
        {"messages": messages_for(1), "temperature": 0, "max_tokens": 12, "stop": stop},
    ).json()
    assert body["choices"][0]["finish_reason"] == "stop_sequence"
    content = body["choices"][0]["message"]["content"]
    assert content.endswith(stop) and reference_text(tiny_llama, long).startswith(content)


def test_24_25_chat_stream(url):
    body = {"messages": messages_for(1), "temperature": 0, "max_tokens": 5, "stream": True}
    chunks = openai_events(post(url, "/v1/chat/completions", body))
    assert len(chunks) == 5
    assert all(c["object"] == "chat.completion.chunk" and c["usage"] is None for c in chunks)
    assert all(
        c["choices"][0]["delta"]["role"] == "assistant" and "content" in c["choices"][0]["delta"]
        for c in chunks
    )
    reasons = [c["choices"][0]["finish_reason"] for c in chunks]
    assert reasons[:-1] == [None] * 4 and reasons[-1] in ("length", "stop")

    body["stream_options"] = {"include_usage": True}
    *chunks, usage = openai_events(post(url, "/v1/chat/completions", body))
    assert len(chunks) == 5 and all(c["usage"] is None for c in chunks)
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 5
    assert usage["usage"]["total_tokens"] == usage["usage"]["prompt_tokens"] + 5


def test_26_chat_logprobs(url):
    # seeded: a sampled EOS (the model is random) would end the answer before 3 tokens
    body = {
        "messages": messages_for(1),
        "max_tokens": 3,
        "logprobs": True,
        "top_logprobs": 2,
        "seed": 7,
    }
    answer = post(url, "/v1/chat/completions", body).json()
    content = answer["choices"][0]["logprobs"]["content"]
    assert len(content) == 3 and all(len(item["top_logprobs"]) == 2 for item in content)
    body["top_logprobs"] = 10
    response = post(url, "/v1/chat/completions", body)
    assert response.status_code == 422 and response.json()["error_type"] == "validation"
    (event,) = openai_events(post(url, "/v1/chat/completions", {**body, "stream": True}))
    assert event["error"]["http_status_code"] == 422
    assert "`top_n_tokens` must be >= 0 and <= 5" in event["error"]["message"]


def test_27_chat_model_echo(url, tiny_llama):
    body = {"messages": messages_for(1), "max_tokens": 2}
    assert post(url, "/v1/chat/completions", {**body, "model": "tgi"}).json()["model"] == str(
        tiny_llama
    )
    answer = post(url, "/v1/chat/completions", {**body, "model": "foo"}).json()
    assert answer["model"] == "foo" and answer["usage"]["completion_tokens"] == 2


def test_30_completions(stories_url):
    response = post(stories_url, "/v1/completions", {"prompt": "Once", "suffix": "end"})
    assert response.status_code == 422
    assert response.json()["error_type"] == "suffix not supported"
    response = post(stories_url, "/v1/completions", {"prompt": ["a"] * 5})
    assert response.status_code == 422
    assert response.json() == {
        "error": "Number of prompts exceeds the maximum allowed batch size of 4",
        "error_type": "batch size exceeded",
    }
    prompts = ["Once upon a time", "The cat"]
    body = {"prompt": prompts, "max_tokens": 6, "temperature": 0}
    answer = post(stories_url, "/v1/completions", body).json()
    assert sorted(c["index"] for c in answer["choices"]) == [0, 1]
    events = openai_events(post(stories_url, "/v1/completions", {**body, "stream": True}))
    for index in (0, 1):
        chunks = [e for e in events if e["choices"][0]["index"] == index]
        assert all(c["choices"][0]["finish_reason"] == "" for c in chunks[:-1])
        assert all("usage" not in c for c in chunks[:-1])
        assert chunks[-1]["choices"][0]["finish_reason"] in ("length", "eos_token")
        assert "".join(c["choices"][0]["text"] for c in chunks) == answer["choices"][index]["text"]
    usages = [e["usage"] for e in events if "usage" in e]
    assert len(usages) == 2
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert sum(u[key] for u in usages) == answer["usage"][key]


def test_32_models(url):
    models = httpx.get(f"{url}/v1/models", timeout=10).json()
    info = httpx.get(f"{url}/info", timeout=10).json()
    assert models["object"] == "list" and len(models["data"]) == 1
    assert models["data"][0]["id"] == info["model_id"]
    assert models["data"][0]["object"] == "model"


def test_chat_without_template_is_422(stories_url):
    response = post(
        stories_url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}
    )
    assert response.status_code == 422
    assert response.json() == {
        "error": "Template error: template not found",
        "error_type": "template_error",
    }

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
from huggingface_hub.errors import UnknownError
from openai.lib.streaming.chat import ChatCompletionStreamState

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


def accumulated(chunks) -> object:
    """The completion the SDK's stream accumulator builds from `chunks` (its snapshot: its
    get_final_completion() refuses answers cut by max_tokens, as for structured outputs)."""
    state = ChatCompletionStreamState()
    for chunk in chunks:
        state.handle_chunk(chunk)
    return state.current_completion_snapshot


def test_sdk_chat_greedy_equals_transformers_and_stream_accumulates(sdk, tiny_llama):
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
    assert answer.model == str(tiny_llama) and answer.id.startswith("chatcmpl-")

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
    assert len({c.id for c in chunks}) == 1 and chunks[0].id != answer.id
    content = "".join(c.choices[0].delta.content or "" for c in token_chunks)
    assert content == choice.message.content
    assert token_chunks[-1].choices[0].finish_reason == choice.finish_reason
    # the SDK's own accumulator builds the same completion from the stream
    final = accumulated(
        sdk.chat.completions.create(
            model="tgi", messages=messages, temperature=0, max_tokens=12, stream=True
        )
    )
    (streamed,) = final.choices
    assert streamed.message.role == "assistant"
    assert streamed.message.content == choice.message.content
    assert streamed.finish_reason == choice.finish_reason
    assert final.id.startswith("chatcmpl-")


def test_sdk_n_choices_stream_and_usage(sdk, tiny_llama):
    messages = messages_for(5)
    expected = reference_text(tiny_llama, chat_reference(tiny_llama, messages, 6))
    answer = sdk.chat.completions.create(
        model="tgi", messages=messages, temperature=0, max_tokens=6, n=3
    )
    assert [c.index for c in answer.choices] == [0, 1, 2]
    assert all(c.message.content == expected for c in answer.choices)  # greedy: all alike
    one = sdk.chat.completions.create(model="tgi", messages=messages, temperature=0, max_tokens=6)
    assert answer.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt counts once
    assert answer.usage.completion_tokens == 3 * one.usage.completion_tokens
    final = accumulated(
        sdk.chat.completions.create(
            model="tgi",
            messages=messages,
            temperature=0.8,
            seed=3,
            max_tokens=6,
            n=2,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert [c.index for c in final.choices] == [0, 1]
    assert all(c.message.role == "assistant" and c.finish_reason for c in final.choices)
    sampled = sdk.chat.completions.create(
        model="tgi", messages=messages, temperature=0.8, seed=3, max_tokens=6, n=2
    )
    # a seeded request replays exactly: choice j draws from seed + j, streamed or not
    assert [c.message.content for c in final.choices] == [
        c.message.content for c in sampled.choices
    ]
    assert final.usage.completion_tokens == sampled.usage.completion_tokens


def test_sdk_stop_strings_are_not_returned(sdk, stories_url, tiny_llama):
    long = chat_reference(tiny_llama, messages_for(1), 12)
    full = reference_text(tiny_llama, long)
    hf = tokenizer(tiny_llama)
    stop = hf.decode(long[3:5]).strip() or hf.decode(long[3:6])  # a piece of the greedy text
    before = full[: full.index(stop)]
    answer = sdk.chat.completions.create(
        model="tgi", messages=messages_for(1), temperature=0, max_tokens=12, stop=stop
    )
    assert answer.choices[0].message.content == before
    assert answer.choices[0].finish_reason == "stop"
    chunks = list(
        sdk.chat.completions.create(
            model="tgi",
            messages=messages_for(1),
            temperature=0,
            max_tokens=12,
            stop=[stop],
            stream=True,
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == before
    client = openai.OpenAI(base_url=f"{stories_url}/v1", api_key="x", max_retries=0, timeout=60)
    text = (
        client.completions.create(
            model="tgi", prompt="Once upon a time", max_tokens=20, temperature=0
        )
        .choices[0]
        .text
    )
    cut = client.completions.create(
        model="tgi", prompt="Once upon a time", max_tokens=20, temperature=0, stop=["Lily"]
    )
    assert "Lily" in text and cut.choices[0].text == text[: text.index("Lily")]
    assert cut.choices[0].finish_reason == "stop"


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
    first = content[0]
    # each alternative's text as it would continue the prompt: its leading space kept
    assert [top.token for top in first.top_logprobs] == [
        reference_text(tiny_llama, [i], prompt_ids) for i in ids.tolist()
    ]
    assert [top.logprob for top in first.top_logprobs] == pytest.approx(values.tolist(), abs=1e-4)
    assert first.logprob == pytest.approx(values[0].item(), abs=1e-4)  # greedy took the top one
    assert first.top_logprobs[0].token == first.token or first.token == ""


def test_sdk_completions_equal_transformers(stories_url, stories_model):
    client = openai.OpenAI(base_url=f"{stories_url}/v1", api_key="x", max_retries=0, timeout=60)
    prompts = ["Once upon a time", "The little dog"]
    eos = eos_token_ids(stories_model)
    prompt_ids = [tokenizer(stories_model)(p).input_ids for p in prompts]  # BOS added
    expected = [greedy_ids(stories_model, p, 10, eos) for p in prompts]
    texts = [reference_text(stories_model, e, ids) for e, ids in zip(expected, prompt_ids)]
    single = client.completions.create(model="tgi", prompt=prompts[0], max_tokens=10, temperature=0)
    assert single.choices[0].text == texts[0]
    assert single.model == str(stories_model) and single.id.startswith("cmpl-")
    both = client.completions.create(model="tgi", prompt=prompts, max_tokens=10, temperature=0)
    assert [c.index for c in both.choices] == [0, 1]
    assert [c.text for c in both.choices] == texts
    assert both.usage.prompt_tokens == sum(len(ids) for ids in prompt_ids)
    assert both.usage.completion_tokens == sum(len(e) for e in expected)
    assert both.usage.total_tokens == both.usage.prompt_tokens + both.usage.completion_tokens
    # n per prompt, prompt by prompt; the legacy logprobs match the greedy tokens
    many = client.completions.create(
        model="tgi", prompt=prompts, max_tokens=10, temperature=0, n=2, logprobs=2
    )
    assert [c.index for c in many.choices] == [0, 1, 2, 3]
    assert [c.text for c in many.choices] == [texts[0], texts[0], texts[1], texts[1]]
    logprobs = many.choices[0].logprobs
    hf = tokenizer(stories_model)
    assert len(logprobs.tokens) == len(expected[0]) == len(logprobs.token_logprobs)
    assert (
        "".join(logprobs.tokens[: len(expected[0])]).strip()
        == hf.decode(expected[0], skip_special_tokens=True).strip()
        or EOS in expected[0]
    )
    assert all(len(top) in (2, 3) for top in logprobs.top_logprobs)  # 2 and the chosen one
    assert logprobs.text_offset[0] == 0 and logprobs.text_offset == sorted(logprobs.text_offset)
    echoed = client.completions.create(
        model="tgi", prompt=prompts[0], max_tokens=10, temperature=0, echo=True
    )
    assert echoed.choices[0].text == prompts[0] + texts[0]
    best = client.completions.create(
        model="tgi", prompt=prompts[0], max_tokens=10, temperature=0.9, best_of=3, seed=1
    )
    assert len(best.choices) == 1 and best.usage.completion_tokens >= 10


def test_sdk_logit_bias_changes_the_greedy_pick(sdk, tiny_llama):
    messages = messages_for(2)
    prompt_ids = templated_ids(tiny_llama, messages)
    with torch.inference_mode():
        logits = reference_model(tiny_llama)(torch.tensor([prompt_ids])).logits[0, -1]
    first, second = torch.topk(logits, 2).indices.tolist()
    banned = sdk.chat.completions.create(
        model="tgi",
        messages=messages,
        temperature=0,
        max_tokens=1,
        logprobs=True,
        logit_bias={str(first): -100},
    )
    assert banned.choices[0].logprobs.content[0].token == reference_text(
        tiny_llama, [second], prompt_ids
    )
    forced = sdk.chat.completions.create(
        model="tgi", messages=messages, temperature=0, max_tokens=3, logit_bias={"300": 100}
    )
    assert forced.choices[0].message.content == reference_text(tiny_llama, [300] * 3, prompt_ids)


def test_sdk_surfaces_errors(sdk):
    with pytest.raises(openai.BadRequestError) as caught:
        sdk.chat.completions.create(model="tgi", messages=messages_for(1), top_p=1.5)
    assert caught.value.code == "validation" and caught.value.param == "top_p"
    assert caught.value.type == "invalid_request_error"
    with pytest.raises(openai.BadRequestError, match="must be > 0.0 and < 1.0"):
        sdk.chat.completions.create(
            model="tgi", messages=messages_for(1), top_p=1.5, stream=True
        )  # refused before the stream starts
    with pytest.raises(openai.BadRequestError) as caught:
        sdk.chat.completions.create(
            model="tgi", messages=messages_for(1), logit_bias={"99999999": 1}
        )
    assert caught.value.param == "logit_bias"
    # top_p 1, OpenAI's default, is accepted
    answer = sdk.chat.completions.create(
        model="tgi", messages=messages_for(1), top_p=1.0, max_tokens=1
    )
    assert answer.usage.completion_tokens == 1


# --- huggingface_hub.InferenceClient ----------------------------------------------------------


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


def test_inference_client_top_tokens_and_api_key(tiny_cluster, tiny_llama, online):
    """huggingface_hub reads the alternatives' texts as the chosen tokens' (leading space
    included), and sends --api-key as `Bearer <key>`; a wrong key is refused."""
    url = tiny_cluster.add_gateway("--api-key", "Secret123")
    client = InferenceClient(base_url=url, api_key="Secret123")
    prompt = prompt_text(6, 5)
    output = client.text_generation(prompt, max_new_tokens=4, details=True, top_n_tokens=2)
    hf = tokenizer(tiny_llama)
    prompt_ids = hf(prompt).input_ids
    # huggingface_hub hands the alternatives over as plain dicts
    first = output.details.top_tokens[0]
    expected = [reference_text(tiny_llama, [t["id"]], prompt_ids) for t in first]
    assert [t["text"] for t in first] == expected
    for chosen, alternatives in zip(output.details.tokens, output.details.top_tokens):
        same = [t["text"] for t in alternatives if t["id"] == chosen.id]
        assert not same or chosen.text in (same[0], "")
    # TGI's error JSON, which huggingface_hub reads into its exception
    with pytest.raises(UnknownError, match="missing or wrong API key"):
        InferenceClient(base_url=url, api_key="secret123").text_generation(prompt, max_new_tokens=2)


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
    # an EOS within 30 tokens -> "stop"; a stop string -> "stop" too, and not in the content
    messages = next(
        m
        for m in (messages_for(i, n) for n in (5, 4, 6) for i in range(40))
        if EOS in chat_reference(tiny_llama, m, 30)
    )
    expected = chat_reference(tiny_llama, messages, 30)
    body = post(
        url, "/v1/chat/completions", {"messages": messages, "temperature": 0, "max_tokens": 30}
    ).json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
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
    assert body["choices"][0]["finish_reason"] == "stop"
    content = body["choices"][0]["message"]["content"]
    full = reference_text(tiny_llama, long)
    assert content == full[: full.index(stop)]


def test_24_25_chat_stream(url):
    body = {"messages": messages_for(1), "temperature": 0, "max_tokens": 5, "stream": True}
    opening, *chunks = openai_events(post(url, "/v1/chat/completions", body))
    assert opening["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert 1 <= len(chunks) <= 5  # one per token; a token still held shows with the next
    assert all(c["object"] == "chat.completion.chunk" and "usage" not in c for c in chunks)
    assert all("role" not in c["choices"][0]["delta"] for c in chunks)
    reasons = [c["choices"][0]["finish_reason"] for c in chunks]
    assert reasons[:-1] == [None] * (len(chunks) - 1) and reasons[-1] in ("length", "stop")

    body["stream_options"] = {"include_usage": True}
    *chunks, usage = openai_events(post(url, "/v1/chat/completions", body))
    assert all(c["usage"] is None for c in chunks)
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
    for stream in (False, True):  # refused before any stream starts
        response = post(url, "/v1/chat/completions", {**body, "stream": stream})
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["code"] == "validation" and error["param"] == "top_logprobs"
        assert "`top_n_tokens` must be >= 0 and <= 5" in error["message"]


def test_27_chat_model_echo(url, tiny_llama):
    body = {"messages": messages_for(1), "max_tokens": 2}
    assert post(url, "/v1/chat/completions", {**body, "model": "tgi"}).json()["model"] == str(
        tiny_llama
    )
    answer = post(url, "/v1/chat/completions", {**body, "model": "foo"}).json()
    assert answer["model"] == "foo" and answer["usage"]["completion_tokens"] == 2


def test_30_completions(stories_url):
    response = post(stories_url, "/v1/completions", {"prompt": "Once", "suffix": "end"})
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "suffix not supported"
    response = post(stories_url, "/v1/completions", {"prompt": ["a"] * 5})
    assert response.status_code == 400
    assert response.json()["error"] == {
        "message": "Number of prompts exceeds the maximum allowed batch size of 4",
        "type": "invalid_request_error",
        "param": "prompt",
        "code": "batch size exceeded",
    }
    prompts = ["Once upon a time", "The cat"]
    body = {"prompt": prompts, "max_tokens": 6, "temperature": 0}
    answer = post(stories_url, "/v1/completions", body).json()
    assert sorted(c["index"] for c in answer["choices"]) == [0, 1]
    assert {c["finish_reason"] for c in answer["choices"]} <= {"length", "stop"}
    streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
    *events, usage = openai_events(post(stories_url, "/v1/completions", streamed))
    for index in (0, 1):
        chunks = [e for e in events if e["choices"][0]["index"] == index]
        assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
        assert all(c["usage"] is None for c in chunks)
        assert (
            chunks[-1]["choices"][0]["finish_reason"] == answer["choices"][index]["finish_reason"]
        )
        assert "".join(c["choices"][0]["text"] for c in chunks) == answer["choices"][index]["text"]
    assert usage["choices"] == [] and usage["usage"] == answer["usage"]
    plain = openai_events(post(stories_url, "/v1/completions", {**body, "stream": True}))
    assert all("usage" not in e for e in plain)


def test_32_models(url):
    models = httpx.get(f"{url}/v1/models", timeout=10).json()
    info = httpx.get(f"{url}/info", timeout=10).json()
    assert models["object"] == "list" and len(models["data"]) == 1
    assert models["data"][0]["id"] == info["model_id"]
    assert models["data"][0]["object"] == "model"


def test_chat_without_template_is_400(stories_url):
    response = post(
        stories_url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}
    )
    assert response.status_code == 400
    assert response.json()["error"] == {
        "message": "Template error: template not found",
        "type": "invalid_request_error",
        "param": None,
        "code": "template_error",
    }

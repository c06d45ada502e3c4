"""Structured output over real HTTP, every dialect: TGI's `grammar` on /generate,
/generate_stream and POST /, OpenAI's `response_format` on chat and completions (the `openai`
SDK's `parse` with a pydantic model), vLLM's structured_outputs and guided_* extras,
huggingface_hub's InferenceClient; outputs validated with jsonschema or matched. Unconstrained
greedy requests running beside constrained ones still equal transformers."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import jsonschema
import openai
import pytest
from huggingface_hub import InferenceClient
from pydantic import BaseModel, Field

from tests.e2e.test_pipeline import prompt_text
from tests.support.cluster import generated_ids
from tests.support.reference import greedy_ids
from tests.worker.test_grammar import CHOICES, PERSON, REGEXES

pytestmark = pytest.mark.integration
SEEDS = (None, 1, 2, 3)


@pytest.fixture(scope="module")
def url(tiny_cluster) -> str:
    return tiny_cluster.gateway_urls[0]


def grammar_parameters(grammar: dict, seed: int | None, max_new_tokens: int = 300) -> dict:
    parameters: dict = {"grammar": grammar, "max_new_tokens": max_new_tokens, "details": True}
    if seed is not None:
        parameters.update(do_sample=True, temperature=1.0, seed=seed)
    return parameters


@pytest.mark.parametrize("seed", SEEDS)
def test_tgi_grammar_json_and_regex(url, seed):
    for grammar, check in [
        ({"type": "json", "value": PERSON}, lambda t: jsonschema.validate(json.loads(t), PERSON)),
        ({"type": "json_schema", "value": {"name": "p", "schema": PERSON}}, None),
        ({"type": "json", "value": json.dumps(PERSON)}, None),
        ({"type": "regex", "value": REGEXES[0]}, lambda t: re.fullmatch(REGEXES[0], t) or 1 / 0),
    ]:
        body = {
            "inputs": prompt_text(seed or 0, 5),
            "parameters": grammar_parameters(grammar, seed),
        }
        response = httpx.post(f"{url}/generate", json=body, timeout=120)
        assert response.status_code == 200, response.text
        answer = response.json()
        assert answer["details"]["finish_reason"] == "eos_token"
        text = answer["generated_text"]
        (check or (lambda t: jsonschema.validate(json.loads(t), PERSON)))(text)


def test_tgi_grammar_streams_and_compat_route(url):
    body = {
        "inputs": "the cat",
        "parameters": grammar_parameters({"type": "json", "value": PERSON}, 5),
    }
    with httpx.stream("POST", f"{url}/generate_stream", json=body, timeout=120) as response:
        assert response.status_code == 200
        events = [
            json.loads(line[5:]) for line in response.iter_lines() if line.startswith("data:")
        ]
    text = "".join(e["token"]["text"] for e in events if not e["token"]["special"])
    assert events[-1]["generated_text"] == text
    jsonschema.validate(json.loads(text), PERSON)
    response = httpx.post(f"{url}/", json={**body, "stream": False}, timeout=120)
    jsonschema.validate(
        json.loads(response.json()[0]["generated_text"].removeprefix("the cat")), PERSON
    )


def test_stories_model_writes_valid_json_only_when_constrained(stories_cluster):
    url = stories_cluster.gateway_urls[0]
    free = httpx.post(
        f"{url}/generate",
        json={"inputs": "Once upon a time", "parameters": {"max_new_tokens": 40}},
        timeout=60,
    )
    with pytest.raises(ValueError):
        json.loads(free.json()["generated_text"])
    for seed in SEEDS:
        body = {
            "inputs": "Once upon a time",
            "parameters": grammar_parameters({"type": "json", "value": PERSON}, seed),
        }
        text = httpx.post(f"{url}/generate", json=body, timeout=120).json()["generated_text"]
        jsonschema.validate(json.loads(text), PERSON)


class Pet(BaseModel):
    kind: str = Field(max_length=8)
    legs: int = Field(ge=0, le=4)


class Owner(BaseModel):
    name: str = Field(max_length=10)
    pets: list[Pet] = Field(max_length=2)


def test_openai_parse_returns_the_pydantic_object(url):
    sdk = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)
    for seed in SEEDS:
        completion = sdk.beta.chat.completions.parse(
            model="tgi",
            messages=[{"role": "user", "content": "an owner and pets"}],
            response_format=Owner,
            max_tokens=300,
            **({"temperature": 0} if seed is None else {"seed": seed}),
        )
        (choice,) = completion.choices
        assert isinstance(choice.message.parsed, Owner), choice.message.content
        assert choice.finish_reason == "stop"
    # any object: keys are free text, which a random model may write until max_tokens
    for seed in range(4):
        (choice,) = sdk.chat.completions.create(
            model="tgi",
            messages=[{"role": "user", "content": "json please"}],
            response_format={"type": "json_object"},
            max_tokens=100,
            seed=seed,
        ).choices
        assert choice.message.content.startswith("{")
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.message.content), dict)


def test_openai_completions_and_vllm_extras(url):
    sdk = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)
    schema_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    text = (
        sdk.completions.create(
            model="tgi",
            prompt="the dog",
            max_tokens=300,
            seed=1,
            extra_body={"response_format": schema_format},
        )
        .choices[0]
        .text
    )
    jsonschema.validate(json.loads(text), PERSON)
    for extra, check in [
        ({"structured_outputs": {"choice": CHOICES}}, lambda t: t in CHOICES),
        ({"guided_choice": CHOICES}, lambda t: t in CHOICES),
        ({"guided_regex": REGEXES[1]}, lambda t: re.fullmatch(REGEXES[1], t)),
        ({"structured_outputs": {"regex": REGEXES[2]}}, lambda t: re.fullmatch(REGEXES[2], t)),
        ({"guided_json": PERSON}, lambda t: jsonschema.validate(json.loads(t), PERSON) or True),
        (
            {"structured_outputs": {"grammar": 'start: "a" B\nB: /[0-9]{2}/'}},
            lambda t: re.fullmatch("a[0-9]{2}", t),
        ),
        ({"guided_grammar": 'root ::= "x" [0-9] [0-9]'}, lambda t: re.fullmatch("x[0-9]{2}", t)),
    ]:
        text = (
            sdk.completions.create(
                model="tgi", prompt="the dog", max_tokens=300, seed=2, extra_body=extra
            )
            .choices[0]
            .text
        )
        assert check(text), (extra, text)
        chat = sdk.chat.completions.create(
            model="tgi",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=300,
            seed=3,
            extra_body=extra,
        )
        assert check(chat.choices[0].message.content), (extra, chat)


def test_inference_client_grammar_and_response_format(url, online):
    client = InferenceClient(base_url=url)
    text = client.text_generation(
        "the cat",
        max_new_tokens=300,
        grammar={"type": "json", "value": PERSON},
        seed=3,
        do_sample=True,
    )
    jsonschema.validate(json.loads(text.removeprefix("the cat")), PERSON)
    answer = client.chat_completion(
        [{"role": "user", "content": "hi"}],
        max_tokens=300,
        seed=1,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}},
    )
    jsonschema.validate(json.loads(answer.choices[0].message.content), PERSON)


async def test_unconstrained_requests_beside_constrained_ones_equal_transformers(url, tiny_llama):
    async with httpx.AsyncClient(base_url=url, timeout=180) as client:

        async def constrained(seed: int) -> None:
            body = {
                "inputs": "x",
                "parameters": grammar_parameters({"type": "json", "value": PERSON}, seed),
            }
            response = await client.post("/generate", json=body)
            jsonschema.validate(json.loads(response.json()["generated_text"]), PERSON)

        async def plain(i: int) -> list[int]:
            return await asyncio.to_thread(generated_ids, url, prompt_text(i, 5), 30)

        results = await asyncio.gather(
            *[constrained(s) for s in range(8)], *[plain(i) for i in range(8)]
        )
    for i, ids in enumerate(results[8:]):
        assert ids == greedy_ids(tiny_llama, prompt_text(i, 5), 30, [2])

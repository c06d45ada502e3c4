"""1,000 generated invalid or pathological constraints against the live stack: every one is
refused before it is queued, with TGI's 422 on /generate and OpenAI's 400 on chat and
completions and a message that says why; never a 5xx, no worker restart, and unconstrained
greedy requests running at the same time still equal transformers. Regexes that make
backtracking engines explode are served (llguidance does not backtrack), also without a 5xx."""

from __future__ import annotations

import asyncio
import json
import random

import httpx
import pytest

from tests.e2e.test_pipeline import prompt_text
from tests.support.cluster import generated_ids
from tests.support.reference import greedy_ids

pytestmark = pytest.mark.integration

BAD_REGEXES = [
    "(?={w})x",
    "(?!{w})",
    "(?<={w})y",
    "({w})\\1",
    "[z-a]{w}",
    "({w}",
    "{w}[",
    "{w}{{5,2}}",
    "*{w}",
    "{w}(?P<n>a)(?P=n)",
    "\\k<x>{w}",
    "{w}\\",
    "[[:alpha:]{w}",
    "a{{99999999999}}{w}",
]
UNIMPLEMENTED = [
    {"uniqueItems": True},
    {"not": {"type": "string"}},
    {"contains": {}},
    {"if": {}, "then": {}},
    {"dependentRequired": {"a": ["b"]}},
    {"propertyNames": {"maxLength": 3}},
    {"unevaluatedProperties": False},
    {"dependentSchemas": {}},
    {"$dynamicRef": "#x"},
]
MALFORMED = [
    {"required": 5},
    {"minLength": -1},
    {"type": "foo"},
    {"type": ["object", "nonsense"]},
    {"type": "integer", "minimum": 9, "maximum": 1},
    {"type": "string", "minLength": 9, "maxLength": 2},
    {"allOf": [{"type": "string"}, {"type": "integer"}]},
    {"$ref": "#/$defs/missing"},
    {"type": "string", "format": "bogus"},
    {"type": "string", "pattern": "(?=a)"},
    {"properties": {"a": {"$ref": "#/nowhere"}}},
    {"type": "array", "items": {"type": "nope"}},
]


def deep(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def generated_cases(rng: random.Random, count: int) -> list[tuple[str, object]]:
    """(kind, payload): "regex" (a pattern), "schema" (a JSON schema), "deep", "enum" and
    "wrapper" (a whole malformed grammar / response_format object)."""
    cases: list[tuple[str, object]] = []
    while len(cases) < count:
        word = "".join(rng.choice("abcxyz01") for _ in range(rng.randint(0, 6)))
        pick = rng.random()
        if pick < 0.35:
            cases.append(("regex", rng.choice(BAD_REGEXES).format(w=word)))
        elif pick < 0.7:
            bad = dict(rng.choice(UNIMPLEMENTED + MALFORMED))
            nested = {"type": "object", "properties": {word or "k": bad}, "required": [word or "k"]}
            cases.append(("schema", bad if rng.random() < 0.5 else nested))
        elif pick < 0.8:
            cases.append(("deep", deep(rng.randint(100, 300))))
        elif pick < 0.82:
            cases.append(
                ("enum", {"enum": [f"{word}{i}" for i in range(rng.randint(100_000, 150_000))]})
            )
        else:
            cases.append(
                (
                    "wrapper",
                    rng.choice(
                        [
                            "tgi-type",
                            "tgi-value",
                            "no-json-schema",
                            "two-kinds",
                            "empty-choice",
                            "bad-json",
                        ]
                    ),
                )
            )
    return cases


def request_for(kind: str, payload, route: str) -> tuple[str, dict]:
    """(path, body) sending the case on `route` ("tgi", "chat" or "completions")."""
    if kind == "wrapper":
        grammar = {
            "tgi-type": {"type": "lark", "value": "x"},
            "tgi-value": {"type": "json"},
            "no-json-schema": {"type": "json_schema"},
            "bad-json": {"type": "json", "value": "{oops"},
        }.get(payload)
        extra = {
            "two-kinds": {"structured_outputs": {"regex": "a", "choice": ["a"]}},
            "empty-choice": {"guided_choice": []},
        }.get(payload)
        if route == "tgi":
            grammar = grammar or {"type": "regex", "value": 5}
            return "/generate", {
                "inputs": "x",
                "parameters": {"grammar": grammar, "max_new_tokens": 2},
            }
        body = extra or {"response_format": grammar}
    elif kind == "regex":
        if route == "tgi":
            return "/generate", {
                "inputs": "x",
                "parameters": {"grammar": {"type": "regex", "value": payload}, "max_new_tokens": 2},
            }
        body = (
            {"guided_regex": payload}
            if route == "chat"
            else {"structured_outputs": {"regex": payload}}
        )
    else:
        if route == "tgi":
            return "/generate", {
                "inputs": "x",
                "parameters": {"grammar": {"type": "json", "value": payload}, "max_new_tokens": 2},
            }
        body = {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": payload},
            }
        }
    if route == "chat":
        return "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "x"}],
            "max_tokens": 2,
            **body,
        }
    return "/v1/completions", {"prompt": "x", "max_tokens": 2, **body}


async def test_a_thousand_bad_constraints_are_refused_and_nothing_else_notices(
    tiny_cluster, tiny_llama
):
    url = tiny_cluster.gateway_urls[0]
    cases = generated_cases(random.Random(18), 1000)
    routes = ["tgi", "chat", "completions"]
    statuses: dict[int, int] = {}
    failures: list[str] = []
    gate = asyncio.Semaphore(8)

    async with httpx.AsyncClient(base_url=url, timeout=60) as client:

        async def send(index: int, kind: str, payload) -> None:
            route = routes[index % 3]
            path, body = request_for(kind, payload, route)
            async with gate:
                response = await client.post(path, json=body)
            statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
            expected = 422 if route == "tgi" else 400
            if response.status_code != expected:
                failures.append(f"{kind} {route} {response.status_code} {response.text[:200]}")
                return
            if route == "tgi":
                message = (
                    response.text
                    if response.text.startswith("Failed")
                    else response.json()["error"]
                )
            else:
                message = response.json()["error"]["message"]
            if len(message) < 20:
                failures.append(f"{kind} {route}: unclear message {message!r}")

        async def plain(i: int) -> list[int]:
            return await asyncio.to_thread(generated_ids, url, prompt_text(i, 5), 25)

        results = await asyncio.gather(
            *[send(i, kind, payload) for i, (kind, payload) in enumerate(cases)],
            *[plain(i) for i in range(6)],
        )
    assert not failures, (len(failures), failures[:10], statuses)
    assert not any(status >= 500 for status in statuses), statuses
    for i, ids in enumerate(results[len(cases) :]):
        assert ids == greedy_ids(tiny_llama, prompt_text(i, 5), 25, [2])
    tiny_cluster.check_alive()  # no service died (a dead worker would be restarted by nobody)


@pytest.mark.parametrize(
    "pattern", ["(a+)+b", "(a|aa)*c", "(x+x+)+y", "(.*a){20}", "(a|b)*a(a|b){18}"]
)
def test_catastrophic_regexes_are_served(tiny_cluster, pattern):
    url = tiny_cluster.gateway_urls[0]
    body = {
        "inputs": "x",
        "parameters": {"grammar": {"type": "regex", "value": pattern}, "max_new_tokens": 8},
    }
    response = httpx.post(f"{url}/generate", json=body, timeout=60)
    assert response.status_code in (200, 422), response.text
    if response.status_code == 422:  # the grammar ran out of its limits on the worker: said so
        assert "grammar" in response.json()["error"]
    tiny_cluster.check_alive()
    json.dumps(response.json())

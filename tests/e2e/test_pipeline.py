"""The whole pipeline through HTTP: gateway -> Redis stream -> scheduler -> worker -> pub/sub.

Oracle: greedy tokens equal transformers' generate, for a request alone and for each of 16
concurrent requests of mixed lengths; batching, joins and chunked prefill really happened;
every KV block is free at the end; both gateways and both worker groups served requests."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tests.support.reference import greedy_ids, tokenizer
from tests.support.tiny_models import WORDS

pytestmark = pytest.mark.integration


def prompt_text(i: int, num_words: int) -> str:
    return " ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(num_words))


def generated_ids(body: dict) -> list[int]:
    return [t["id"] for t in body["details"]["tokens"]]


async def generate(client: httpx.AsyncClient, url: str, prompt: str, max_new_tokens: int) -> dict:
    response = await client.post(
        f"{url}/generate",
        json={"inputs": prompt, "parameters": {"max_new_tokens": max_new_tokens, "details": True}},
        timeout=120,
    )
    assert response.status_code == 200, response.text
    return response.json()


async def stream_ids(
    client: httpx.AsyncClient, url: str, prompt: str, max_new_tokens: int, started: asyncio.Event
) -> list[int]:
    """/generate_stream's token ids; `started` is set at the first."""
    ids = []
    body = {"inputs": prompt, "parameters": {"max_new_tokens": max_new_tokens}}
    async with client.stream("POST", f"{url}/generate_stream", json=body, timeout=120) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data:"):
                ids.append(json.loads(line[5:])["token"]["id"])
                started.set()
    return ids


def test_single_request_matches_transformers(tiny_cluster, tiny_llama):
    prompt = prompt_text(0, 12)
    body = asyncio.run(_one(tiny_cluster.gateway_urls[0], prompt, 30))
    assert generated_ids(body) == greedy_ids(tiny_llama, prompt, 30, [2])
    assert body["details"]["generated_tokens"] == len(body["details"]["tokens"])


async def _one(url: str, prompt: str, max_new_tokens: int) -> dict:
    async with httpx.AsyncClient() as client:
        return await generate(client, url, prompt, max_new_tokens)


def test_sixteen_concurrent_mixed_requests_match_transformers(tiny_cluster, tiny_llama):
    # mixed prompt lengths (3..~180 tokens: the longest exceed the 64-token prefill budget)
    # and output lengths; the second half arrives while the first half decodes
    cases = [(prompt_text(i, 2 + (i * 11) % 60), 6 + (i * 7) % 40) for i in range(16)]
    before = tiny_cluster.wait_idle()  # published after the last test's requests ended
    bodies = asyncio.run(_many(tiny_cluster.gateway_urls, cases))
    for (prompt, max_new_tokens), body in zip(cases, bodies):
        assert generated_ids(body) == greedy_ids(tiny_llama, prompt, max_new_tokens, [2]), prompt
    after = tiny_cluster.wait_idle()
    delta = {g: (after[g], before.get(g)) for g in after}
    assert all(s.num_free_blocks == s.num_blocks for s in after.values()), after
    assert all(s.num_running == 0 and s.num_waiting == 0 for s in after.values())
    assert max(s.max_step_batch_size for s in after.values()) > 1
    joined = sum(
        a.num_joined_running - (b.num_joined_running if b else 0) for a, b in delta.values()
    )
    chunks = sum(
        a.num_prefill_chunks - (b.num_prefill_chunks if b else 0) for a, b in delta.values()
    )
    mixed = sum(a.num_mixed_steps - (b.num_mixed_steps if b else 0) for a, b in delta.values())
    assert joined > 0, "no request joined a running batch"
    assert chunks > 0, "no prompt was prefilled in chunks"
    assert mixed > 0, "no step prefilled and decoded together"
    finished = {g: a.num_finished - (b.num_finished if b else 0) for g, (a, b) in delta.items()}
    assert all(n > 0 for n in finished.values()), f"a worker group did no work: {finished}"
    assert sum(finished.values()) == 16


async def _many(urls: list[str], cases: list[tuple[str, int]]) -> list[dict]:
    async with httpx.AsyncClient() as client:
        first = [
            asyncio.create_task(generate(client, urls[i % len(urls)], p, n))
            for i, (p, n) in enumerate(cases[:8])
        ]
        await asyncio.sleep(0.3)
        second = [
            asyncio.create_task(generate(client, urls[(i + 1) % len(urls)], p, n))
            for i, (p, n) in enumerate(cases[8:])
        ]
        return list(await asyncio.gather(*first, *second))


DECODE = 400  # tokens of the requests decoding while the long prompt comes


def test_long_prompt_is_chunked_while_others_decode(tiny_cluster, tiny_llama):
    long_prompt = prompt_text(3, 150)  # several times the 64-token prefill budget
    assert len(tokenizer(tiny_llama)(long_prompt).input_ids) > 3 * 64
    before = tiny_cluster.wait_idle()  # published after the last test's requests ended

    async def scenario():
        async with httpx.AsyncClient() as client:
            url = tiny_cluster.gateway_urls[0]
            started = [asyncio.Event() for _ in range(4)]
            decoders = [
                asyncio.create_task(stream_ids(client, url, prompt_text(i, 4), DECODE, started[i]))
                for i in range(4)
            ]
            # each has streamed a token, so all decode now with hundreds to go (the groups'
            # stats lag by up to 0.25 s, longer than 4 streams of 400 tokens took on 2 cores)
            await asyncio.wait_for(asyncio.gather(*(event.wait() for event in started)), 60)
            long = await generate(client, url, long_prompt, 10)
            return long, await asyncio.gather(*decoders)

    long, decoders = asyncio.run(scenario())
    assert generated_ids(long) == greedy_ids(tiny_llama, long_prompt, 10, [2])
    for i, ids in enumerate(decoders):
        assert ids == greedy_ids(tiny_llama, prompt_text(i, 4), DECODE, [2])
    after = tiny_cluster.wait_idle()
    chunks = sum(after[g].num_prefill_chunks - before[g].num_prefill_chunks for g in after)
    mixed = sum(after[g].num_mixed_steps - before[g].num_mixed_steps for g in after)
    assert chunks >= 3 and mixed >= 1
    assert all(s.num_free_blocks == s.num_blocks for s in after.values())


def sse_events(text: str) -> list[dict]:
    events = []
    for block in text.split("\n\n"):
        block = block.strip()
        if block.startswith("data:"):
            events.append(json.loads(block[len("data:") :]))
    return events


def test_generate_stream_events(tiny_cluster, tiny_llama):
    prompt = prompt_text(5, 10)
    with httpx.Client(timeout=60) as client:
        response = client.post(
            f"{tiny_cluster.gateway_urls[1]}/generate_stream",
            json={"inputs": prompt, "parameters": {"max_new_tokens": 25, "details": True}},
        )
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    events = sse_events(response.text)
    assert [e["index"] for e in events] == list(range(1, len(events) + 1))
    assert all(e["generated_text"] is None and e["details"] is None for e in events[:-1])
    final = events[-1]
    ids = [e["token"]["id"] for e in events]
    assert ids == greedy_ids(tiny_llama, prompt, 25, [2])
    text = "".join(e["token"]["text"] for e in events if not e["token"]["special"])
    assert text == final["generated_text"]
    tok = tokenizer(tiny_llama)
    prompt_ids = tok(prompt).input_ids
    full = tok.decode(prompt_ids + ids, skip_special_tokens=True)
    assert full == tok.decode(prompt_ids, skip_special_tokens=True) + final["generated_text"]
    assert final["details"]["generated_tokens"] == len(events)
    assert final["details"]["finish_reason"] in ("length", "eos_token")
    assert final["details"]["input_length"] == len(prompt_ids)


VALIDATION = [
    (
        {"inputs": "Hi", "parameters": {"max_new_tokens": 0}},
        "Input validation error: `max_new_tokens` must be strictly positive",
    ),
    (
        {"inputs": "Hi", "parameters": {"top_p": 1.0}},
        "Input validation error: `top_p` must be > 0.0 and < 1.0",
    ),
    (
        {"inputs": "Hi", "parameters": {"temperature": 0}},
        "Input validation error: `temperature` must be strictly positive",
    ),
    (
        {"inputs": "Hi", "parameters": {"stop": ["a", "b", "c", "d", "e"]}},
        "Input validation error: `stop` supports up to 4 stop sequences. Given: 5",
    ),
    ({"inputs": "", "parameters": {}}, "Input validation error: `inputs` cannot be empty"),
]


@pytest.mark.parametrize("body,message", VALIDATION)
def test_validation_errors(tiny_cluster, body, message):
    response = httpx.post(f"{tiny_cluster.gateway_urls[0]}/generate", json=body, timeout=30)
    assert response.status_code == 422
    assert response.json() == {"error": message, "error_type": "validation"}


def test_validation_of_lengths(tiny_cluster):
    url = tiny_cluster.gateway_urls[0]
    too_long = " ".join(["the cat sat on the mat"] * 200)  # > 511 input tokens
    response = httpx.post(
        f"{url}/generate",
        timeout=30,
        json={"inputs": too_long, "parameters": {"max_new_tokens": 5}},
    )
    assert response.status_code == 422
    assert response.json()["error_type"] == "validation"
    assert "must have less than 511 tokens" in response.json()["error"]
    prompt = prompt_text(1, 40)
    response = httpx.post(
        f"{url}/generate",
        timeout=30,
        json={"inputs": prompt, "parameters": {"max_new_tokens": 500}},
    )
    assert response.status_code == 422
    assert "`inputs` tokens + `max_new_tokens` must be <= 512" in response.json()["error"]
    ok = httpx.post(
        f"{url}/generate",
        timeout=30,
        json={"inputs": "Hi", "parameters": {"top_p": 0.9, "max_new_tokens": 2}},
    )
    assert ok.status_code == 200


def test_top_p_point_nine_and_sampling_work_and_stream_validation_is_in_band(tiny_cluster):
    url = tiny_cluster.gateway_urls[1]
    response = httpx.post(
        f"{url}/generate_stream",
        timeout=30,
        json={"inputs": "Hi", "parameters": {"max_new_tokens": 0}},
    )
    assert response.status_code == 200
    (event,) = sse_events(response.text)
    assert event["error_type"] == "validation"
    sampled = [
        httpx.post(
            f"{url}/generate",
            timeout=30,
            json={
                "inputs": "Hi",
                "parameters": {"do_sample": True, "seed": 5, "max_new_tokens": 8, "details": True},
            },
        ).json()
        for _ in range(2)
    ]
    assert sampled[0]["generated_text"] == sampled[1]["generated_text"]
    assert sampled[0]["details"]["seed"] == 5


def test_real_model_writes_the_documented_story(stories_cluster):
    """stories260k, greedy, 40 tokens from 'Once upon a time' (its SOURCE.md)."""
    response = httpx.post(
        f"{stories_cluster.gateway_urls[0]}/generate",
        timeout=60,
        json={"inputs": "Once upon a time", "parameters": {"max_new_tokens": 40, "details": True}},
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert [t["id"] for t in body["details"]["tokens"]] == [
        432,
        383,
        286,
        261,
        376,
        298,
        315,
        421,
        395,
        317,
        426,
        338,
        401,
        396,
        267,
        337,
        410,
        408,
        419,
        292,
        411,
        322,
        265,
        282,
        295,
        433,
        426,
        385,
        328,
        432,
        358,
        394,
        261,
        370,
        432,
        352,
        266,
        268,
        388,
        426,
    ]
    assert body["generated_text"] == (
        ", there was a little girl named Lily. She loved to play outside in the park. "
        "One day, she saw a big, red ball."
    )


def test_real_model_concurrent_parity(stories_cluster, stories_model):
    prompts = [
        "Once upon a time",
        "The little dog",
        "Lily and Tom went to the park",
        "One day, a big bird",
        "Tim had a red ball. He",
        "The sun was hot",
    ] * 2
    lengths = [20 + (i * 13) % 60 for i in range(len(prompts))]
    bodies = asyncio.run(_many(stories_cluster.gateway_urls, list(zip(prompts, lengths))))
    for prompt, n, body in zip(prompts, lengths, bodies):
        assert generated_ids(body) == greedy_ids(stories_model, prompt, n, [2]), prompt
    stats = stories_cluster.wait_idle()
    assert all(s.num_free_blocks == s.num_blocks for s in stats.values())


def test_client_disconnect_and_stop_sequence_free_the_blocks(tiny_cluster, tiny_llama):
    """An abandoned stream and a stop-sequence hit end the request on the scheduler: its blocks
    come back and nothing keeps decoding."""
    url = tiny_cluster.gateway_urls[0]
    before = tiny_cluster.wait_idle()  # published after the last test's requests ended
    with httpx.Client(timeout=60) as client:
        with client.stream(
            "POST",
            f"{url}/generate_stream",
            json={"inputs": prompt_text(2, 8), "parameters": {"max_new_tokens": 400}},
        ) as response:
            for line in response.iter_lines():
                if line.startswith("data:"):
                    break  # first token arrived: walk away
    expected = greedy_ids(tiny_llama, prompt_text(4, 6), 40, [2])
    text = tokenizer(tiny_llama).decode(expected[:12], skip_special_tokens=True)
    stop = text[-3:]
    body = httpx.post(
        f"{url}/generate",
        timeout=60,
        json={
            "inputs": prompt_text(4, 6),
            "parameters": {"max_new_tokens": 40, "stop": [stop], "details": True},
        },
    ).json()
    assert body["details"]["finish_reason"] == "stop_sequence"
    assert body["generated_text"].endswith(stop)
    assert body["details"]["generated_tokens"] < 40
    after = tiny_cluster.wait_idle()
    assert all(s.num_free_blocks == s.num_blocks and s.num_running == 0 for s in after.values())
    finished = sum(after[g].num_finished - before[g].num_finished for g in after)
    assert finished == 0, "aborted requests must not run to completion"

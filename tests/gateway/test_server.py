"""The gateway over real HTTP (uvicorn in a thread) and real Redis, with a stand-in worker."""

from __future__ import annotations

import asyncio
import contextlib
import time

import httpx
import redis.asyncio as aioredis

from services.gateway.pipeline.tokenizer import TextTokenizer
from shared.channels import Channels
from shared.codec import decode, encode
from shared.messages import AbortRequest, Heartbeat, WorkerReady
from shared.net import free_port
from shared.settings import Settings
from tests.gateway.peer import CONTINUATION, WorkerPeer
from tests.support.gateway_server import serve, sse_events
from tests.support.redis_server import redis_server


async def test_generate_details_and_headers(http, peer):
    response = await http.post(
        "/generate",
        json={"inputs": "once upon", "parameters": {"max_new_tokens": 5, "details": True}},
    )
    assert response.status_code == 200, response.text
    body = response.json()
    details = body["details"]
    assert details["finish_reason"] == "length"
    assert details["generated_tokens"] == 5 == len(details["tokens"])
    assert details["seed"] is None and details["prefill"] == []
    assert "top_tokens" not in details and "best_of_sequences" not in details
    assert "".join(t["text"] for t in details["tokens"]) == body["generated_text"]
    assert CONTINUATION.startswith(body["generated_text"])
    assert response.headers["x-generated-tokens"] == "5"
    request = peer.requests[-1]
    assert response.headers["x-prompt-tokens"] == str(len(request.input_ids))
    assert request.input_ids[0] == 1  # BOS added
    assert request.stopping.max_new_tokens == 5 and not request.sampling.do_sample
    assert request.reply_to == peer.channels.reply(request.reply_to.rsplit(":", 1)[1])
    for name in (
        "x-compute-type",
        "x-compute-time",
        "x-compute-characters",
        "x-total-time",
        "x-validation-time",
        "x-queue-time",
        "x-inference-time",
        "x-time-per-token",
    ):
        assert name in response.headers
    assert response.headers["x-compute-characters"] == str(len("once upon"))
    float(response.headers["x-compute-time"])


async def test_generate_eos_sampling_full_text_and_top_tokens(http, peer):
    response = await http.post("/generate", json={"inputs": "hello"})  # no parameters: sampling
    assert response.status_code == 200 and "details" not in response.json()
    assert peer.requests[-1].sampling.do_sample
    response = await http.post(
        "/generate",
        json={
            "inputs": "hello",
            "parameters": {
                "details": True,
                "do_sample": True,
                "return_full_text": True,
                "top_n_tokens": 2,
            },
        },
    )
    body = response.json()
    assert body["details"]["finish_reason"] == "eos_token"
    assert body["details"]["seed"] == peer.requests[-1].sampling.seed
    assert isinstance(body["details"]["seed"], int)
    assert body["generated_text"] == "hello" + CONTINUATION
    assert body["details"]["tokens"][-1] == {
        "id": 2,
        "text": "</s>",
        "logprob": -0.5,
        "special": True,
    }
    assert all(len(tops) == 2 for tops in body["details"]["top_tokens"])
    compat = await http.post("/", json={"inputs": "hello", "parameters": {"max_new_tokens": 2}})
    assert isinstance(compat.json(), list) and compat.json()[0]["generated_text"].startswith(
        "hello"
    )


async def test_best_of(http, peer):
    response = await http.post(
        "/generate",
        json={
            "inputs": "hi",
            "parameters": {"best_of": 2, "do_sample": True, "details": True, "max_new_tokens": 3},
        },
    )
    assert response.status_code == 200, response.text
    assert len(response.json()["details"]["best_of_sequences"]) == 1
    seeds = {r.sampling.seed for r in peer.requests[-2:]}
    assert len(seeds) == 2


async def test_stream(http, peer):
    response = await http.post(
        "/generate_stream",
        json={"inputs": "once", "parameters": {"max_new_tokens": 4, "details": True}},
    )
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    assert response.headers["x-accel-buffering"] == "no"
    events = sse_events(response.text)
    assert [e["index"] for e in events] == [1, 2, 3, 4]
    assert all(e["generated_text"] is None and e["details"] is None for e in events[:-1])
    final = events[-1]
    assert final["generated_text"] == "".join(e["token"]["text"] for e in events)
    assert final["details"] == {
        "finish_reason": "length",
        "generated_tokens": 4,
        "seed": None,
        "input_length": len(peer.requests[-1].input_ids),
    }
    assert "top_tokens" not in final


async def test_stream_validation_error_is_in_stream(http, peer):
    for parameters, text in [
        ({"max_new_tokens": 0}, "`max_new_tokens` must be strictly positive"),
        ({"best_of": 2}, "not supported when streaming tokens"),
    ]:
        response = await http.post(
            "/generate_stream", json={"inputs": "x", "parameters": parameters}
        )
        assert response.status_code == 200
        (event,) = sse_events(response.text)
        assert event["error_type"] == "validation" and text in event["error"]


async def test_validation_and_body_errors(http):
    response = await http.post(
        "/generate", json={"inputs": "Hi", "parameters": {"max_new_tokens": 0}}
    )
    assert response.status_code == 422
    assert response.json() == {
        "error": "Input validation error: `max_new_tokens` must be strictly positive",
        "error_type": "validation",
    }
    long_prompt = " ".join(["the cat"] * 40)
    response = await http.post(
        "/generate", json={"inputs": long_prompt, "parameters": {"max_new_tokens": 2}}
    )
    assert response.status_code == 422 and "must have less than 32 tokens" in response.text
    response = await http.post("/generate", content=b'{"inputs": "x"}')
    assert response.status_code == 415
    response = await http.post(
        "/generate", content=b"{", headers={"content-type": "application/json"}
    )
    assert response.status_code == 400 and response.text.startswith("Failed to parse")
    response = await http.post("/generate", json={"parameters": {}})
    assert response.status_code == 422 and response.text.startswith("Failed to deserialize")


async def test_stop_sequence_aborts(http, peer, redis_url, namespace):
    listener = aioredis.from_url(redis_url)
    pubsub = listener.pubsub()
    await pubsub.subscribe(Channels(namespace).aborts)
    try:
        response = await http.post(
            "/generate", json={"inputs": "x", "parameters": {"stop": ["sat"], "details": True}}
        )
        body = response.json()
        assert body["details"]["finish_reason"] == "stop_sequence"
        assert body["generated_text"] == " the cat sat"
        message = None
        deadline = time.time() + 5
        while message is None and time.time() < deadline:
            message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=0.5)
        assert message is not None
        abort = decode(message["data"], AbortRequest)
        assert abort.request_id == peer.requests[-1].request_id
        assert abort.reason == "stop_sequence"
    finally:
        await pubsub.aclose()
        await listener.aclose()


async def test_worker_error_is_424(http, peer):
    response = await http.post("/generate", json={"inputs": "FAIL", "parameters": {}})
    assert response.status_code == 424
    assert response.json() == {
        "error": "Request failed during generation: worker exploded",
        "error_type": "generation",
    }


async def test_info_tokenize_metrics(http, peer, settings):
    info = (await http.get("/info")).json()
    assert info["model_id"] == settings.model_id
    assert (info["max_input_tokens"], info["max_total_tokens"]) == (32, 64)
    for key in (
        "max_concurrent_requests",
        "max_best_of",
        "max_stop_sequences",
        "max_client_batch_size",
        "version",
        "max_batch_total_tokens",
    ):
        assert key in info
    tokens = (await http.post("/tokenize", json={"inputs": "the cat"})).json()
    response = await http.post(
        "/generate", json={"inputs": "the cat", "parameters": {"max_new_tokens": 1}}
    )
    assert len(tokens) == int(response.headers["x-prompt-tokens"])
    assert tokens[0]["text"] == "<s>" and tokens[-1]["stop"] == len("the cat")
    text = (await http.get("/metrics")).text
    assert "tgi_request_count " in text and "tgi_request_success " in text
    for name in (
        "tgi_request_duration_bucket",
        "tgi_request_input_length_bucket",
        "tgi_request_generated_tokens_bucket",
        "tgi_queue_size",
        "tgi_request_validation_duration",
        "tgi_request_queue_duration",
        "tgi_request_inference_duration",
        "tgi_request_mean_time_per_token_duration",
        "tgi_batch_current_size",
    ):
        assert name in text
    assert "_total" not in text


async def test_health(http, redis_url, namespace):
    assert (await http.get("/live")).status_code == 200
    response = await http.get("/health")
    assert response.status_code == 503
    assert response.json() == {"error": "unhealthy", "error_type": "healthcheck"}
    channels = Channels(namespace)
    client = aioredis.from_url(redis_url)
    try:
        await client.sadd(channels.groups, "g0")
        await client.set(
            channels.worker("g0"),
            encode(
                WorkerReady(
                    group="g0",
                    model_id="m",
                    num_blocks=1,
                    block_size=16,
                    max_batch_size=1,
                    max_model_len=64,
                )
            ),
        )
        assert (await http.get("/health")).status_code == 503  # no heartbeat yet
        await client.set(
            channels.heartbeat("g0"), encode(Heartbeat(group="g0", at=time.time())), ex=10
        )
        for path in ("/health", "/", "/ping", "/ready"):
            response = await http.get(path)
            assert response.status_code == 200 and response.content == b""
    finally:
        await client.aclose()


async def test_overload_and_disconnect(settings, peer):
    settings = settings.model_copy(update={"max_concurrent_requests": 1})
    with serve(settings) as url:
        async with httpx.AsyncClient(base_url=url, timeout=10) as http:
            slow = asyncio.create_task(
                http.post(
                    "/generate", json={"inputs": "SLOW", "parameters": {"max_new_tokens": 10}}
                )
            )
            await asyncio.sleep(0.3)
            response = await http.post("/generate", json={"inputs": "x", "parameters": {}})
            assert response.status_code == 429
            assert response.json() == {"error": "Model is overloaded", "error_type": "overloaded"}
            response = await http.post("/generate_stream", json={"inputs": "x"})
            assert response.status_code == 200
            assert sse_events(response.text)[0]["error_type"] == "overloaded"
            slow.cancel()  # the client goes away: the slot must come back
            with contextlib.suppress(asyncio.CancelledError):
                await slow
            await asyncio.sleep(0.3)
            response = await http.post(
                "/generate", json={"inputs": "x", "parameters": {"max_new_tokens": 2}}
            )
            assert response.status_code == 200
            metrics = (await http.get("/metrics")).text
            assert 'tgi_request_failure{err="dropped"} 1' in metrics
            assert 'tgi_request_failure{err="overloaded"} 2' in metrics


async def test_redis_down_is_503(tokenizer_dir):
    settings = Settings(redis_url=f"redis://127.0.0.1:{free_port()}/0", model_id=str(tokenizer_dir))
    with serve(settings) as url:
        async with httpx.AsyncClient(base_url=url, timeout=10) as http:
            started = time.time()
            response = await http.post("/generate", json={"inputs": "x", "parameters": {}})
            assert response.status_code == 503
            assert response.json()["error_type"] == "unavailable"
            assert (await http.get("/health")).status_code == 503
            assert time.time() - started < 5


async def test_deadline_and_stream_disconnect_abort(settings, peer, redis_url, namespace):
    settings = settings.model_copy(update={"request_timeout": 0.5, "api_key": "Secret"})
    listener = aioredis.from_url(redis_url)
    pubsub = listener.pubsub()
    await pubsub.subscribe(Channels(namespace).aborts)
    auth = {"Authorization": "Bearer Secret"}
    try:
        with serve(settings) as url:
            async with httpx.AsyncClient(base_url=url, timeout=10) as http:
                response = await http.post("/generate", json={"inputs": "x"})
                assert response.status_code == 401
                assert response.json()["error_type"] == "unauthorized"
                assert (await http.get("/info")).status_code == 200
                response = await http.post(
                    "/generate", headers=auth, json={"inputs": "SILENT", "parameters": {}}
                )
                assert response.status_code == 424 and "deadline" in response.json()["error"]
                async with http.stream(
                    "POST",
                    "/generate_stream",
                    headers=auth,
                    json={"inputs": "SLOW", "parameters": {"max_new_tokens": 10}},
                ) as stream:
                    async for line in stream.aiter_lines():
                        if line.startswith("data:"):
                            break  # one token seen: hang up
                reasons = set()
                deadline = time.time() + 5
                while len(reasons) < 2 and time.time() < deadline:
                    message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=0.5)
                    if message is not None:
                        reasons.add(decode(message["data"], AbortRequest).reason)
                assert reasons == {"deadline", "dropped"}
    finally:
        await pubsub.aclose()
        await listener.aclose()


async def test_a_full_queue_is_429_and_intake_is_one_round_trip(settings, tokenizer_dir):
    """The queue-length check and the XADD are one script call (they were an XLEN per lane,
    then the XADD): with --max-queue-length 2, the lanes holding 3 entries refuse the next.
    On a Redis of its own: the command counters are server-wide, and the session's other
    clusters' schedulers run their intake script on the shared one."""
    with redis_server() as redis_url:
        async with WorkerPeer(
            redis_url, settings.namespace, TextTokenizer.from_folder(tokenizer_dir)
        ):
            await count_intake_calls(settings, redis_url)


async def count_intake_calls(settings: Settings, redis_url: str) -> None:
    settings = settings.model_copy(update={"max_queue_length": 2, "redis_url": redis_url})
    client = aioredis.from_url(redis_url)

    async def calls(command: str) -> int:
        """Calls that ran (a first EVALSHA on a new server fails with NOSCRIPT)."""
        stats = (await client.info("commandstats")).get(f"cmdstat_{command}", {})
        return int(stats.get("calls", 0)) - int(stats.get("failed_calls", 0))

    try:
        with serve(settings) as url:
            async with httpx.AsyncClient(base_url=url, timeout=10) as http:
                body = {"inputs": "a", "parameters": {"max_new_tokens": 1}}
                before = {c: await calls(c) for c in ("evalsha", "eval", "xadd", "xlen")}
                for _ in range(3):  # the stand-in worker leaves every entry in the stream
                    assert (await http.post("/generate", json=body)).status_code == 200
                full = await http.post("/generate", json=body)
                assert full.status_code == 429 and full.json()["error_type"] == "overloaded"
                after = {c: await calls(c) for c in before}
    finally:
        await client.aclose()
    assert after["xadd"] - before["xadd"] == 3
    assert after["evalsha"] - before["evalsha"] == 4  # one call per request, refused or not
    assert after["eval"] - before["eval"] <= 1  # the script's source, sent once (NOSCRIPT)
    assert after["xlen"] - before["xlen"] == 4 * 3  # inside the script, one per lane

"""Secrets stay out of logs: shared.bus.redact_url, TLS/password URLs accepted by connect(), and
a gateway that cannot reach Redis logs the URL without its password, never the api key."""

from __future__ import annotations

import logging

import pytest

from shared.redis_connect import connect, redact_url


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://user:s3cret@redis.example:6379/0", "redis://user:***@redis.example:6379/0"),
        ("redis://:s3cret@10.0.0.1:6379", "redis://:***@10.0.0.1:6379"),
        (
            "rediss://default:p%40ss%3Aw@cache.example:6380/1",
            "rediss://default:***@cache.example:6380/1",
        ),
        ("rediss://cache.example:6380", "rediss://cache.example:6380"),
        ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
        ("unix:///run/redis.sock?db=0&password=s3cret", "unix:///run/redis.sock?db=0&password=***"),
        ("redis://[::1]:6379/0", "redis://[::1]:6379/0"),
        ("", ""),
        (None, ""),
    ],
)
def test_redact_url(url, shown):
    assert redact_url(url) == shown
    assert "s3cret" not in redact_url(url) and "p%40ss" not in redact_url(url)


async def test_connect_accepts_tls_and_password_urls():
    client = connect("rediss://user:s3cret@cache.example:6380/2")  # constructs, no connection
    kwargs = client.connection_pool.connection_kwargs
    assert (kwargs["username"], kwargs["password"], kwargs["db"]) == ("user", "s3cret", 2)
    assert "SSL" in client.connection_pool.connection_class.__name__
    await client.aclose()
    client = connect("redis://:s3cret@127.0.0.1:6379/0")
    assert client.connection_pool.connection_kwargs["password"] == "s3cret"
    assert "s3cret" not in repr(client)
    await client.aclose()


async def test_gateway_never_logs_secrets(tokenizer_dir, caplog):
    import httpx

    from shared.net import free_port
    from shared.settings import Settings
    from tests.support.gateway_server import serve

    url = f"redis://admin:s3cret@127.0.0.1:{free_port()}/0"
    settings = Settings(redis_url=url, model_id=str(tokenizer_dir), api_key="k3y-s3cret")
    caplog.set_level(logging.DEBUG)
    with serve(settings) as base:
        async with httpx.AsyncClient(base_url=base, timeout=5) as http:
            headers = {"Authorization": "Bearer k3y-s3cret"}
            response = await http.post("/generate", json={"inputs": "x"}, headers=headers)
            assert response.status_code == 503
            assert "s3cret" not in response.text
    assert "admin:***@127.0.0.1" in caplog.text
    assert "s3cret" not in caplog.text

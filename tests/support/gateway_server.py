"""The gateway app served by uvicorn in a background thread, for gateway tests (real HTTP
without the other services: tests/gateway/peer.py plays the worker over real Redis)."""

from __future__ import annotations

import contextlib
import json
import threading
import time

import uvicorn

from services.gateway.app import create_app
from shared.net import free_port
from shared.settings import Settings


@contextlib.contextmanager
def serve(settings: Settings):
    """Run the gateway app with uvicorn in a background thread; yield its base URL."""
    port = free_port()
    config = uvicorn.Config(create_app(settings), host="127.0.0.1", port=port, log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 10
    while not server.started and time.time() < deadline:
        time.sleep(0.01)
    assert server.started, "uvicorn did not start"
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def sse_events(text: str) -> list[dict]:
    assert "[DONE]" not in text
    blocks = [b for b in text.split("\n\n") if b.strip()]
    assert all(b.startswith("data: ") for b in blocks), blocks
    return [json.loads(b[len("data: ") :]) for b in blocks]

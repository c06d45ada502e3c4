"""The bench's lean HTTP/1.1 streaming client against a scripted socket server: chunked SSE
split at awkward places, keep-alive reuse, error answers and a connection that drops."""

from __future__ import annotations

import asyncio
import json

import pytest

from services.bench.sse_client import HTTPError, StreamingClient


def chunked(*payloads: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in payloads) + b"0\r\n\r\n"


def sse(*events: dict) -> list[bytes]:
    return [f"data:{json.dumps(event)}\n\n".encode() for event in events]


class Server:
    """Answers each request on a connection with the next scripted response, written in
    pieces of `piece` bytes with a pause between them (so the client parses partial data)."""

    def __init__(self, responses: list[bytes], piece: int = 7, close_after: int | None = None):
        self.responses = responses
        self.piece = piece
        self.close_after = close_after  # bytes of the first response to send before hanging up
        self.requests: list[bytes] = []
        self.connections = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        while self.responses:
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
            self.requests.append(head + await reader.readexactly(length))
            response = self.responses.pop(0)
            if self.close_after is not None:
                response = response[: self.close_after]
            for start in range(0, len(response), self.piece):
                writer.write(response[start : start + self.piece])
                await writer.drain()
                await asyncio.sleep(0)
            if self.close_after is not None:
                break
        writer.close()

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self.handle, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    async def __aexit__(self, *exc) -> None:
        self.server.close()


def streamed(events: list[bytes]) -> bytes:
    head = (
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    )
    # one SSE event spread over two chunks, and two events in one chunk
    joined = b"".join(events)
    return head + chunked(joined[:10], joined[10:25], joined[25:])


async def collect(client: StreamingClient, body: dict) -> tuple[int, bytes, list[dict]]:
    lines: list[dict] = []

    def on_line(line: bytes, at: float) -> None:
        assert at > 0
        if line.startswith(b"data:"):
            lines.append(json.loads(line[5:]))

    status, error = await client.post_stream("/generate_stream", body, on_line)
    return status, error, lines


async def test_chunked_events_in_order_and_the_connection_is_reused():
    first = sse({"token": {"id": 1}}, {"token": {"id": 2}}, {"token": {"id": 3}, "details": {}})
    second = sse({"token": {"id": 9}})
    server = Server([streamed(first), streamed(second)])
    async with server as url:
        client = StreamingClient(url, timeout_s=5)
        status, _, events = await collect(client, {"inputs": "a"})
        assert status == 200
        assert [event["token"]["id"] for event in events] == [1, 2, 3]
        status, _, events = await collect(client, {"inputs": "b"})
        assert [event["token"]["id"] for event in events] == [9]
        client.close()
    assert server.connections == 1  # keep-alive
    assert [json.loads(r.split(b"\r\n\r\n", 1)[1]) for r in server.requests] == [
        {"inputs": "a"},
        {"inputs": "b"},
    ]
    assert server.requests[0].startswith(b"POST /generate_stream HTTP/1.1\r\n")


async def test_an_error_answer_returns_its_status_and_body():
    body = b'{"error":"Input validation error","error_type":"validation"}'
    response = b"HTTP/1.1 422 Unprocessable Entity\r\ncontent-length: %d\r\n\r\n%s" % (
        len(body),
        body,
    )
    async with Server([response]) as url:
        client = StreamingClient(url, timeout_s=5)
        status, error, events = await collect(client, {"inputs": ""})
        client.close()
    assert (status, error, events) == (422, body, [])


async def test_a_dropped_connection_raises_instead_of_hanging():
    response = streamed(sse({"token": {"id": 1}}, {"token": {"id": 2}}))
    async with Server([response], close_after=len(response) - 12) as url:
        client = StreamingClient(url, timeout_s=5)
        with pytest.raises(HTTPError, match="closed"):
            await collect(client, {"inputs": "a"})
        client.close()


async def test_only_plain_http_urls():
    with pytest.raises(ValueError, match="plain http"):
        StreamingClient("https://example.com", timeout_s=1)

"""A lean HTTP/1.1 client for streamed POSTs, for the load generator.

The bench runs on the machine it measures, so its own CPU is taken from the server: httpx's
stack (anyio, httpcore, h11) spent ~140 us of CPU per received token. This client is one
asyncio Protocol per keep-alive connection that parses the status line, the headers and a
chunked (or Content-Length) body as bytes arrive, and hands each SSE `data:` line to a
callback with the time its bytes arrived: a few microseconds per token.

Only what the bench needs: plain http://, POST with a JSON body, keep-alive reuse.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from urllib.parse import urlsplit

OnLine = Callable[[bytes, float], None]  # (an SSE line of the body, perf_counter at arrival)


class HTTPError(Exception):
    """The connection failed or the answer was not HTTP."""


class _Answer:
    """The state of one response being parsed."""

    def __init__(self, on_line: OnLine) -> None:
        self.on_line = on_line
        self.status = 0
        self.is_chunked = False
        self.remaining = -1  # Content-Length bytes still to read (-1: chunked or unknown)
        self.body = bytearray()  # non-streamed body (an error answer)
        self.done: asyncio.Future[int] = asyncio.get_running_loop().create_future()


class _Connection(asyncio.Protocol):
    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buffer = b""
        self.lines = b""  # SSE bytes not yet ending in a newline
        self.answer: _Answer | None = None
        self.in_head = True
        self.is_lost = False

    def connection_made(self, transport) -> None:
        self.transport = transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.is_lost = True
        if self.answer is not None and not self.answer.done.done():
            self.answer.done.set_exception(HTTPError(f"connection closed: {exc}"))

    def send(self, request: bytes, answer: _Answer) -> None:
        self.answer, self.in_head, self.buffer, self.lines = answer, True, b"", b""
        assert self.transport is not None
        self.transport.write(request)

    def data_received(self, data: bytes) -> None:
        at = time.perf_counter()
        self.buffer += data
        try:
            self._parse(at)
        except (ValueError, IndexError) as exc:
            if self.answer is not None and not self.answer.done.done():
                self.answer.done.set_exception(HTTPError(f"malformed response: {exc}"))
            if self.transport is not None:
                self.transport.close()

    def _parse(self, at: float) -> None:
        answer = self.answer
        if answer is None or answer.done.done():
            return
        if self.in_head:
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            head, self.buffer = self.buffer[:end].decode("latin-1"), self.buffer[end + 4 :]
            status_line, *header_lines = head.split("\r\n")
            answer.status = int(status_line.split(" ", 2)[1])
            for line in header_lines:
                name, _, value = line.partition(":")
                name, value = name.strip().lower(), value.strip()
                if name == "transfer-encoding" and "chunked" in value.lower():
                    answer.is_chunked = True
                elif name == "content-length":
                    answer.remaining = int(value)
            self.in_head = False
        if answer.is_chunked:
            self._chunks(answer, at)
        elif answer.remaining < 0:  # neither chunked nor sized: nothing the bench expects
            raise ValueError("a response body with neither a length nor chunks")
        else:
            self._feed(answer, self.buffer[: max(answer.remaining, 0)], at)
            answer.remaining -= len(self.buffer)
            self.buffer = b""
            if answer.remaining <= 0:
                self._finish(answer)

    def _chunks(self, answer: _Answer, at: float) -> None:
        while True:
            line_end = self.buffer.find(b"\r\n")
            if line_end < 0:
                return
            size = int(self.buffer[:line_end].split(b";", 1)[0], 16)
            if len(self.buffer) < line_end + 2 + size + 2:
                return
            start = line_end + 2
            self._feed(answer, self.buffer[start : start + size], at)
            self.buffer = self.buffer[start + size + 2 :]
            if size == 0:
                self._finish(answer)
                return

    def _feed(self, answer: _Answer, data: bytes, at: float) -> None:
        if answer.status != 200:
            answer.body += data
            return
        self.lines += data
        *complete, self.lines = self.lines.split(b"\n")
        for line in complete:
            answer.on_line(line, at)

    def _finish(self, answer: _Answer) -> None:
        if self.lines:
            answer.on_line(self.lines, time.perf_counter())
            self.lines = b""
        answer.done.set_result(answer.status)


class StreamingClient:
    """POST JSON to one server and stream the answers; a pool of keep-alive connections."""

    def __init__(self, base_url: str, timeout_s: float) -> None:
        parts = urlsplit(base_url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"the bench client speaks plain http://host:port, not {base_url}")
        self.host = parts.hostname
        self.port = parts.port or 80
        self.timeout_s = timeout_s
        self._idle: list[_Connection] = []

    async def post_stream(self, path: str, body: dict, on_line: OnLine) -> tuple[int, bytes]:
        """Send the request; on_line gets each line of a 200 answer as it arrives. Returns the
        status and, for other statuses, the body. Raises HTTPError or TimeoutError."""
        payload = json.dumps(body).encode()
        request = (
            f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
            "Content-Type: application/json\r\nAccept: text/event-stream\r\n"
            f"Content-Length: {len(payload)}\r\n\r\n"
        ).encode() + payload
        connection = await self._connection()
        answer = _Answer(on_line)
        connection.send(request, answer)
        try:
            status = await asyncio.wait_for(answer.done, self.timeout_s)
        except BaseException:
            if connection.transport is not None:
                connection.transport.close()
            raise
        if not connection.is_lost:
            self._idle.append(connection)
        return status, bytes(answer.body)

    async def _connection(self) -> _Connection:
        while self._idle:
            connection = self._idle.pop()
            if not connection.is_lost:
                return connection
        loop = asyncio.get_running_loop()
        try:
            _transport, connection = await loop.create_connection(_Connection, self.host, self.port)
        except OSError as exc:
            raise HTTPError(f"cannot connect to {self.host}:{self.port}: {exc}") from exc
        return connection

    def close(self) -> None:
        for connection in self._idle:
            if connection.transport is not None:
                connection.transport.close()
        self._idle.clear()

"""The torch thread's Redis line on a real Redis: plans arrive while the caller is busy (an XREAD
is always out), writes do not wait for replies, an error reply is counted, the steps stream is
trimmed, and a dropped connection costs one error, never a plan nor a write."""

from __future__ import annotations

import time

import pytest
import redis

from services.worker.step_link import TRIM_EVERY, StepLink, xadd
from shared.bus import REDIS_ERRORS
from tests.support.redis_server import redis_server


def wait_for(condition, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@pytest.fixture
def client(redis_url):
    client = redis.Redis.from_url(redis_url)
    try:
        yield client
    finally:
        client.close()


@pytest.fixture
def steps(namespace, client):
    key = f"{namespace}:steps"
    yield key
    client.delete(key)


def wait_until(condition, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_the_next_plan_lands_while_the_caller_computes(redis_url, client, steps):
    link = StepLink(redis_url, steps)
    try:
        assert link.read(block_ms=50) == []  # nothing yet; the next XREAD is now out
        assert not link.has_arrived()
        entry_id = client.xadd(steps, {b"m": b"plan 1"})
        wait_until(link.has_arrived)  # in the socket without a call from the link
        assert link.read() == [(entry_id, {b"m": b"plan 1"})]
        ids = [client.xadd(steps, {b"m": f"plan {i}".encode()}) for i in (2, 3)]
        wait_until(link.has_arrived)
        read = []
        while len(read) < 2:  # the XREAD out may have answered with plan 2 alone
            read += link.read()
        assert [entry_id for entry_id, _ in read] == ids
        assert link.last_id == ids[-1]
    finally:
        link.close()


def test_writes_leave_at_once_and_an_error_reply_is_counted(redis_url, client, namespace):
    errors = []
    link = StepLink(redis_url, f"{namespace}:steps", on_error_reply=lambda: errors.append(1))
    stream, not_a_stream = f"{namespace}:results", f"{namespace}:string"
    client.set(not_a_stream, b"x")
    try:
        link.send([xadd(stream, {b"m": b"1"}, 10), ("PUBLISH", f"{namespace}:ch", b"hi")])
        link.send([xadd(not_a_stream, {b"m": b"2"}, 10)])  # WRONGTYPE, answered later
        wait_until(lambda: client.xlen(stream) == 1)
        time.sleep(0.05)  # the error reply arrives
        link.send([xadd(stream, {b"m": b"3"}, 10)])  # reads the replies that arrived first
        assert errors == [1]
        wait_until(lambda: client.xlen(stream) == 2)
        fields = [entry[1] for entry in client.xrange(stream)]
        assert fields == [{b"m": b"1"}, {b"m": b"3"}]
    finally:
        link.close()
        client.delete(stream, not_a_stream)


def test_the_steps_stream_is_trimmed_to_what_was_read(redis_url, client, steps):
    """XTRIM MINID ~ drops whole stream nodes (100 entries each by default): of 300 entries read,
    at most the last node's stay."""
    link = StepLink(redis_url, steps)
    try:
        for i in range(300):
            client.xadd(steps, {b"m": str(i).encode()})
        read = []
        while len(read) < 300:
            read += link.read(block_ms=50)
        assert link.last_id == read[-1][0]
        assert link.read(block_ms=50) == []  # an empty read trims too
        wait_until(lambda: client.xlen(steps) <= 100)
        assert client.xrange(steps, count=1)[0][0] > read[300 - 100 - TRIM_EVERY][0]
    finally:
        link.close()


def test_a_dropped_connection_costs_one_error_and_no_plan(namespace):
    """On a Redis of its own: it drops every client but its own."""
    with redis_server() as url:
        client = redis.Redis.from_url(url)
        try:
            drop_and_reconnect(url, client, f"{namespace}:steps")
            drop_the_sender(url, client, f"{namespace}:steps")
        finally:
            client.close()


def drop_and_reconnect(url: str, client: redis.Redis, steps: str) -> None:
    """Redis drops both connections (a restart): the read raises once, the next one
    reconnects from the last plan read, and the next write reaches the new connection."""
    link = StepLink(url, steps)
    try:
        first = client.xadd(steps, {b"m": b"1"})
        assert [entry_id for entry_id, _ in link.read()] == [first]
        link.send([("PING",)])  # the sender is connected too
        client.client_kill_filter(_type="normal", skipme=True)  # every other client
        second = client.xadd(steps, {b"m": b"2"})
        with pytest.raises(REDIS_ERRORS):
            link.read()
        assert [entry_id for entry_id, _ in link.read()] == [second]  # reconnected, from `first`
        link.send([xadd(f"{steps}:out", {b"step": b"0"}, 100)])  # not into the dead socket
        wait_for(lambda: client.xlen(f"{steps}:out") == 1)
    finally:
        link.close()


def drop_the_sender(url: str, client: redis.Redis, steps: str) -> None:
    """Only the sender's connection is dropped, between two writes: the next write raises
    instead of vanishing into the closed socket, and its retry is delivered once."""
    out = f"{steps}:sender-out"
    link = StepLink(url, steps)
    try:
        link.send([("PING",)])
        host, port = link._sender._sock.getsockname()[:2]
        client.client_kill_filter(addr=f"{host}:{port}")
        time.sleep(0.05)  # the server's close reaches the socket
        with pytest.raises(REDIS_ERRORS):
            link.send([xadd(out, {b"step": b"1"}, 100)])
        link.send([xadd(out, {b"step": b"1"}, 100)])  # the retry
        wait_for(lambda: client.xlen(out) == 1)
        time.sleep(0.1)
        assert client.xlen(out) == 1
    finally:
        link.close()


def test_a_write_the_demoted_primary_refused_is_sent_again_once_it_takes_writes(namespace):
    """The primary becomes a replica (REPLICAOF, as Sentinel demotes one): the write it refused
    with READONLY is not lost; the next write reconnects and sends it again first."""
    with redis_server() as url, redis_server() as other_url:
        client = redis.Redis.from_url(url)
        other = redis.Redis.from_url(other_url)
        out = f"{namespace}:demoted-out"
        link = StepLink(url, f"{namespace}:steps")
        try:
            link.send([("PING",)])
            port = other.connection_pool.connection_kwargs["port"]
            client.replicaof("127.0.0.1", port)  # the link's server is a replica now
            link.send([xadd(out, {b"m": b"1"}, 100)])  # refused: READONLY
            wait_for(lambda: link._sender.can_read(0))
            client.replicaof("NO", "ONE")  # the old data is gone (it synced from `other`)
            with pytest.raises(ConnectionError, match="became a replica"):
                link.send([xadd(out, {b"m": b"2"}, 100)])
            link.send([xadd(out, {b"m": b"3"}, 100)])
            wait_for(lambda: client.xlen(out) == 2)
            assert [e[1] for e in client.xrange(out)] == [{b"m": b"1"}, {b"m": b"3"}]
        finally:
            link.close()
            client.close()
            other.close()


def test_a_read_the_server_unblocked_raises_a_connection_error_and_the_retry_reads(namespace):
    """Redis ends a blocked XREAD with UNBLOCKED when a failover demotes it (CLIENT UNBLOCK ...
    ERROR gives the same reply): the link raises a Redis connection error, which the worker
    retries, instead of a ResponseError that would end its loop; the retry reads on."""
    with redis_server() as url:
        client = redis.Redis.from_url(url)
        steps = f"{namespace}:unblocked"
        link = StepLink(url, steps)
        try:
            client.xadd(steps, {b"m": b"0"})
            assert len(link.read(block_ms=10_000)) == 1  # and the next XREAD blocks 10 s

            def blocked() -> list[dict]:
                return [c for c in client.client_list() if c["cmd"] == "xread"]

            wait_for(lambda: bool(blocked()))
            client.client_unblock(int(blocked()[0]["id"]), error=True)
            with pytest.raises(redis.ConnectionError, match="UNBLOCKED|unblocked"):
                link.read()
            entry = client.xadd(steps, {b"m": b"1"})
            assert [entry_id for entry_id, _ in link.read()] == [entry]
        finally:
            link.close()
            client.close()

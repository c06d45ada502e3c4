"""Adding a request to its stream: one script checks the queue's length and XADDs (a 429 past
--max-queue-length), and with --redis-wait-replicas N a WAIT in the same pipeline holds the
answer until N replicas have the entry (one connection: WAIT counts only that connection's
writes; ../shared/reference/redis-ha.md measured +15-35 us p50 per request on loopback). On a
Redis Cluster that pipeline goes to the lanes' node itself (a cluster client sends WAIT to a
node of its choosing).

A WAIT that times out short is logged and counted, and the request goes on rather than
stalling intake (a primary left without replicas after a failover would refuse every request):
if its primary then fails before replicating it, this gateway re-submits it when its reply
subscription drops (services/gateway/pipeline/resume.py).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import MovedError

from services.gateway.metrics import GatewayMetrics
from shared.bus import FIELD
from shared.redis_connect import node_client

log = logging.getLogger(__name__)

WAIT_TIMEOUT_MS = 100  # how long an XADD waits for --redis-wait-replicas replicas
# KEYS: the lanes (their lengths count), then the stream to add to. ARGV: the most entries
# waiting, the field, the message. False when the lanes are full.
ENQUEUE = """
local waiting = 0
for i = 1, #KEYS - 1 do waiting = waiting + redis.call('XLEN', KEYS[i]) end
if waiting > tonumber(ARGV[1]) then return false end
return redis.call('XADD', KEYS[#KEYS], '*', ARGV[2], ARGV[3])
"""


class Intake:
    def __init__(
        self,
        client: aioredis.Redis,
        metrics: GatewayMetrics,
        max_queue_length: int,
        wait_replicas: int = 0,
    ) -> None:
        self.client = client
        self.metrics = metrics
        self.max_queue_length = max_queue_length  # entries waiting in the lanes, at most
        self.wait_replicas = wait_replicas  # --redis-wait-replicas (0: no WAIT)
        self._enqueue = client.register_script(ENQUEUE)
        # on a cluster: the lanes' node (its name, a plain client to it)
        self._node: tuple[str, aioredis.Redis] | None = None

    async def add(self, keys: list[str], data: bytes) -> bytes | None:
        """The new entry's id, or None when the lanes are full. keys: the lanes, then the
        stream to add to."""
        args: list[bytes | int | str] = [self.max_queue_length, FIELD, data]
        if not self.wait_replicas:
            entry_id: bytes | None = await self._enqueue(keys=keys, args=args)
            return entry_id
        started = time.perf_counter()
        try:
            entry_id, replicas = await self._add_waiting(keys, args)
        except (MovedError, aioredis.ConnectionError) as exc:
            if not isinstance(self.client, aioredis.RedisCluster):
                raise
            # a failover or a resharding moved the lanes, or their node is gone: ask again
            log.info("asking the Redis Cluster where the request lanes are (%s)", exc)
            await self.client.nodes_manager.initialize()
            entry_id, replicas = await self._add_waiting(keys, args)
        self.metrics.intake_wait.observe(time.perf_counter() - started)
        if entry_id is not None and replicas < self.wait_replicas:
            self.metrics.num_unreplicated += 1
            log.warning("a request reached %d of %d replicas", replicas, self.wait_replicas)
        return entry_id

    async def _add_waiting(self, keys: list[str], args: list[bytes | int | str]) -> list[Any]:
        """[entry id or None, replicas that have it]: the script and WAIT in one pipeline."""
        async with (await self._node_of(keys[-1])).pipeline(transaction=False) as pipe:
            await self._enqueue(keys=keys, args=args, client=pipe)
            pipe.wait(self.wait_replicas, WAIT_TIMEOUT_MS)
            replies: list[Any] = await pipe.execute()
            return replies

    async def _node_of(self, key: str) -> aioredis.Redis:
        """The client whose connection writes `key`: the plain one, or on a cluster the client
        of the node serving it (every lane is in one slot); a move is logged (the master
        watch counts it)."""
        if not isinstance(self.client, aioredis.RedisCluster):
            return self.client
        node = self.client.get_node_from_key(key)
        name = node.name if node is not None else ""
        if self._node is None or name != self._node[0]:
            old, self._node = self._node, (name, node_client(self.client, key))
            if old is not None:  # replaced first: a request arriving meanwhile takes the new one
                log.warning("the request lanes moved to Redis Cluster node %s", name)
                await old[1].aclose()
        return self._node[1]

"""Redis key, stream and channel names. Everything lives under one namespace prefix so several
deployments (or tests) can share a Redis server.

Every name starts with a Redis Cluster hash tag (the first `{...}`: only it decides the key's
slot), so what one command or script touches lies in one slot:

    {ns}:...            the lanes, the groups' directed streams, and the rest of the shared
                        keys: the intake script counts the lanes and adds to a lane or a
                        directed stream; a scheduler's blocking read waits on its directed
                        stream and the lanes at once
    {ns:group:<g>}:...  one worker group's steps, results, worker, heartbeat, scheduler and
                        drain keys: groups spread over a cluster's shards
"""

from __future__ import annotations

from dataclasses import dataclass

SCHEDULER_GROUP = "schedulers"  # consumer group of the request stream
DEAD_LETTERS_MAXLEN = 10_000  # entries the dead-letters stream keeps (trimmed approximately)


@dataclass(frozen=True)
class Channels:
    namespace: str = "textgen"

    def __post_init__(self) -> None:
        if "{" in self.namespace or "}" in self.namespace:
            raise ValueError(f"namespace must not hold {{ or }} (hash tags): {self.namespace!r}")

    @property
    def tag(self) -> str:
        """The prefix of the keys and channels every group uses (one cluster slot)."""
        return f"{{{self.namespace}}}"

    def group_tag(self, group: str) -> str:
        """The prefix of one group's keys (one cluster slot per group)."""
        return f"{{{self.namespace}:group:{group}}}"

    @property
    def requests(self) -> str:
        """Stream of GenerateRequest (the normal lane, priority 0); group SCHEDULER_GROUP."""
        return f"{self.tag}:requests"

    def lane(self, priority: int) -> str:
        """The request stream of a priority: > 0 high, 0 normal, < 0 low (FCFS in a lane)."""
        if priority > 0:
            return f"{self.tag}:requests:high"
        if priority < 0:
            return f"{self.tag}:requests:low"
        return self.requests

    @property
    def lanes(self) -> list[str]:
        """Every request stream, most urgent first."""
        return [self.lane(1), self.lane(0), self.lane(-1)]

    @property
    def aborts(self) -> str:
        """Pub/sub channel of AbortRequest, heard by every scheduler."""
        return f"{self.tag}:aborts"

    @property
    def dead_letters(self) -> str:
        """Stream of bus messages nobody could read (malformed, newer schema), for operators."""
        return f"{self.tag}:dead-letters"

    @property
    def groups(self) -> str:
        """Set of worker group ids that ever announced themselves."""
        return f"{self.tag}:groups"

    def reply(self, gateway_id: str) -> str:
        """Pub/sub channel of ReplyBatch for one gateway."""
        return f"{self.tag}:reply:{gateway_id}"

    def steps(self, group: str) -> str:
        """Stream of StepPlan for a worker group."""
        return f"{self.group_tag(group)}:steps"

    def results(self, group: str) -> str:
        """Stream of StepResult from a worker group."""
        return f"{self.group_tag(group)}:results"

    def directed(self, group: str) -> str:
        """Request stream of one group: requests a gateway routed there because the group
        holds their LoRA adapter. Its scheduler reads it before the lanes; every scheduler
        takes its entries once the group stops beating or drains."""
        return f"{self.tag}:directed:{group}"

    def worker(self, group: str) -> str:
        """Key holding the group's WorkerReady."""
        return f"{self.group_tag(group)}:worker"

    def heartbeat(self, group: str) -> str:
        """Key holding the group's last Heartbeat; expires when the group stops beating."""
        return f"{self.group_tag(group)}:heartbeat"

    def scheduler_stats(self, group: str) -> str:
        """Key holding the SchedulerStats of the group's scheduler."""
        return f"{self.group_tag(group)}:scheduler"

    def drain(self, group: str) -> str:
        """Key whose presence tells the group's scheduler to stop pulling new requests
        (`textgen queue drain GROUP`); requests it already holds still finish."""
        return f"{self.group_tag(group)}:drain"

    @property
    def adapters(self) -> str:
        """Hash of the LoRA adapters clients may select: name -> AdapterRef (shared/adapters.py)."""
        return f"{self.tag}:adapters"

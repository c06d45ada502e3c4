"""Redis key, stream and channel names. Everything lives under one namespace prefix so several
deployments (or tests) can share a Redis server."""

from __future__ import annotations

from dataclasses import dataclass

SCHEDULER_GROUP = "schedulers"  # consumer group of the request stream
DEAD_LETTERS_MAXLEN = 10_000  # entries the dead-letters stream keeps (trimmed approximately)


@dataclass(frozen=True)
class Channels:
    namespace: str = "textgen"

    @property
    def requests(self) -> str:
        """Stream of GenerateRequest (the normal lane, priority 0); group SCHEDULER_GROUP."""
        return f"{self.namespace}:requests"

    def lane(self, priority: int) -> str:
        """The request stream of a priority: > 0 high, 0 normal, < 0 low (FCFS in a lane)."""
        if priority > 0:
            return f"{self.namespace}:requests:high"
        if priority < 0:
            return f"{self.namespace}:requests:low"
        return self.requests

    @property
    def lanes(self) -> list[str]:
        """Every request stream, most urgent first."""
        return [self.lane(1), self.lane(0), self.lane(-1)]

    @property
    def aborts(self) -> str:
        """Pub/sub channel of AbortRequest, heard by every scheduler."""
        return f"{self.namespace}:aborts"

    @property
    def dead_letters(self) -> str:
        """Stream of bus messages nobody could read (malformed, newer schema), for operators."""
        return f"{self.namespace}:dead-letters"

    @property
    def groups(self) -> str:
        """Set of worker group ids that ever announced themselves."""
        return f"{self.namespace}:groups"

    def reply(self, gateway_id: str) -> str:
        """Pub/sub channel of ReplyBatch for one gateway."""
        return f"{self.namespace}:reply:{gateway_id}"

    def steps(self, group: str) -> str:
        """Stream of StepPlan for a worker group."""
        return f"{self.namespace}:group:{group}:steps"

    def results(self, group: str) -> str:
        """Stream of StepResult from a worker group."""
        return f"{self.namespace}:group:{group}:results"

    def directed(self, group: str) -> str:
        """Request stream of one group: requests a gateway routed there because the group
        holds their LoRA adapter. Its scheduler reads it before the lanes; every scheduler
        takes its entries once the group stops beating or drains."""
        return f"{self.namespace}:group:{group}:requests"

    def worker(self, group: str) -> str:
        """Key holding the group's WorkerReady."""
        return f"{self.namespace}:group:{group}:worker"

    def heartbeat(self, group: str) -> str:
        """Key holding the group's last Heartbeat; expires when the group stops beating."""
        return f"{self.namespace}:group:{group}:heartbeat"

    def scheduler_stats(self, group: str) -> str:
        """Key holding the SchedulerStats of the group's scheduler."""
        return f"{self.namespace}:group:{group}:scheduler"

    def drain(self, group: str) -> str:
        """Key whose presence tells the group's scheduler to stop pulling new requests
        (`textgen queue drain GROUP`); requests it already holds still finish."""
        return f"{self.namespace}:group:{group}:drain"

    @property
    def adapters(self) -> str:
        """Hash of the LoRA adapters clients may select: name -> AdapterRef (shared/adapters.py)."""
        return f"{self.namespace}:adapters"

"""The scheduler's view of one request."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from shared.messages import GenerateRequest, NewRequest


class RequestStatus(enum.IntEnum):
    """Ordered: everything from FINISHED on is final."""

    WAITING = 0  # pulled from the stream, no blocks yet (or preempted)
    RUNNING = 1  # holds blocks, scheduled every step until done
    FINISHED = 2  # the worker reported a finish reason
    ABORTED = 3  # the gateway gave up (client gone, stop sequence)
    EXPIRED = 4  # its deadline passed before it finished
    FAILED = 5  # the worker failed the step that held it
    HANDED_BACK = 6  # requeued with its tokens for another group (shutdown)

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED


@dataclass
class SchedRequest:
    message: GenerateRequest  # as received; resent in full after preemption
    entry_id: bytes  # stream entry id, acknowledged when the request ends
    stream: str  # the request stream (priority lane) the entry is in
    arrival: int  # arrival order among requests of this scheduler
    token_ids: list[int] = field(default_factory=list)  # prompt + generated so far
    num_prompt_tokens: int = 0  # len(message.input_ids)
    num_computed_tokens: int = 0  # tokens whose KV is in the worker's cache (as planned)
    num_inflight_samples: int = 0  # tokens being sampled by steps sent but not answered yet
    block_ids: list[int] = field(default_factory=list)  # block table
    status: RequestStatus = RequestStatus.WAITING
    is_on_worker: bool = False  # the worker holds its state (sent as NewRequest)
    scheduled_at: float = 0.0  # unix s of the first scheduling
    error: str = ""  # why the scheduler failed it (the service tells the gateway)
    pulled_at: float = 0.0  # unix s the scheduler took it from the stream
    num_hashed_blocks: int = 0  # leading blocks registered in the prefix cache
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at admission

    @classmethod
    def from_message(
        cls, message: GenerateRequest, entry_id: bytes, arrival: int, stream: str = ""
    ) -> SchedRequest:
        return cls(
            message=message,
            entry_id=entry_id,
            stream=stream,
            arrival=arrival,
            token_ids=list(message.input_ids) + list(message.generated_ids),
            num_prompt_tokens=len(message.input_ids),
        )

    @property
    def request_id(self) -> str:
        return self.message.request_id

    @property
    def adapter_id(self) -> str:
        """Its LoRA adapter's registration id; empty for the base model."""
        adapter = self.message.adapter
        return adapter.id if adapter is not None else ""

    @property
    def num_generated_ids(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_known_tokens(self) -> int:
        """Tokens known here plus those the worker samples in steps not answered yet (it
        holds them already, so the next step can compute them: overlapped scheduling)."""
        return len(self.token_ids) + self.num_inflight_samples

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_known_tokens - self.num_computed_tokens

    @property
    def sort_key(self) -> tuple[int, int]:
        """Waiting-queue order: priority (high first), then arrival."""
        return (-self.message.priority, self.arrival)

    def lookahead(self, num_tokens: int, num_speculative_tokens: int) -> int:
        """KV slots to hold beyond a greedy decode of `num_tokens` for the worker's speculative
        proposals (up to num_speculative_tokens each): that many per step in flight, since a
        step planned before the previous one is answered starts where that one's accepted
        proposals end. Never past the request's last token."""
        n = num_speculative_tokens
        if not n or num_tokens != 1 or not self.message.sampling.can_speculate:
            return 0
        if self.num_computed_tokens + 1 != self.num_known_tokens:
            return 0  # not a decode (a prompt chunk ends here)
        remaining = self.num_prompt_tokens + self.message.stopping.max_new_tokens
        remaining -= self.num_computed_tokens + 1
        return max(0, min(n * (1 + self.num_inflight_samples), remaining))

    def as_new(self, num_tokens: int) -> NewRequest:
        """What the worker needs to hold it, with `num_tokens` to compute in its first step."""
        message = self.message
        return NewRequest(
            request_id=self.request_id,
            input_ids=message.input_ids,
            generated_ids=self.token_ids[self.num_prompt_tokens :],
            sampling=message.sampling,
            stopping=message.stopping,
            reply_to=message.reply_to,
            block_ids=list(self.block_ids),
            num_computed_tokens=self.num_computed_tokens,
            num_scheduled_tokens=num_tokens,
            scheduled_at=self.scheduled_at,
            traceparent=message.traceparent,
            adapter=message.adapter,
            attempt=message.attempt,
        )

"""What the worker remembers about a request between steps (it caches by request id; the
scheduler sends full data once, then diffs)."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.worker.grammar import RequestGrammar
from shared.messages import AdapterRef, FinishReason, NewRequest, SamplingParams, StoppingParams


@dataclass
class RequestState:
    request_id: str
    token_ids: list[int]  # prompt + generated
    num_prompt_tokens: int
    block_ids: list[int]  # block table
    num_computed_tokens: int  # tokens whose KV is in the cache
    sampling: SamplingParams
    stopping: StoppingParams
    reply_to: str
    scheduled_at: float = 0.0
    traceparent: str = ""
    has_sent_first_event: bool = False
    num_scheduled_tokens: int = 0  # of the step being executed
    finish_reason: FinishReason | None = field(default=None)
    prompt_logprobs: list[float] = field(default_factory=list)  # filled chunk by chunk if asked
    is_resumed: bool = False  # arrived with generated tokens: its first event went out before
    first_step_at: float = 0.0  # unix s of its first step on this worker (for its span)
    num_steps: int = 0  # steps it took part in on this worker
    draft_ids: list[int] = field(default_factory=list)  # speculative proposals of this step
    grammar: RequestGrammar | None = None  # its constraint's matcher (services/worker/grammar.py)
    adapter: AdapterRef | None = None  # its LoRA adapter (services/worker/lora.py); None: base
    attempt: int = 0  # NewRequest.attempt, echoed in its token events

    @classmethod
    def from_new(cls, new: NewRequest) -> RequestState:
        return cls(
            request_id=new.request_id,
            token_ids=list(new.input_ids) + list(new.generated_ids),
            num_prompt_tokens=len(new.input_ids),
            block_ids=list(new.block_ids),
            num_computed_tokens=new.num_computed_tokens,
            sampling=new.sampling,
            stopping=new.stopping,
            reply_to=new.reply_to,
            scheduled_at=new.scheduled_at,
            traceparent=new.traceparent,
            num_scheduled_tokens=new.num_scheduled_tokens,
            is_resumed=bool(new.generated_ids),
            adapter=new.adapter,
            attempt=new.attempt,
        )

    @property
    def shape(self) -> str:
        """id, blocks held, tokens computed and scheduled: a failed step's log line."""
        blocks, computed = len(self.block_ids), self.num_computed_tokens
        return f"{self.request_id}: {blocks} blocks, {computed}+{self.num_scheduled_tokens}"

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Asked for, and not delivered yet (a resumed request delivered them before)."""
        return (
            self.sampling.prefill_logprobs and not self.has_sent_first_event and not self.is_resumed
        )

    @property
    def samples_this_step(self) -> bool:
        """The step computes the last known token, so its logits give the next one."""
        return self.num_computed_tokens + self.num_scheduled_tokens == len(self.token_ids)


def stop_reason(
    state: RequestState, token_id: int, eos_token_ids: set[int], max_model_len: int
) -> FinishReason | None:
    """Token-level stop rules after appending token_id. Length wins over EOS (TGI)."""
    if (
        state.num_generated >= state.stopping.max_new_tokens
        or len(state.token_ids) >= max_model_len
    ):
        return FinishReason.LENGTH
    if token_id in state.stopping.stop_token_ids:
        return FinishReason.EOS_TOKEN
    if token_id in eos_token_ids and (not state.stopping.ignore_eos or state.grammar is not None):
        return FinishReason.EOS_TOKEN  # a grammar allows EOS only where the output is complete
    return None

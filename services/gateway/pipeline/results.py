"""A generation as the routes see it: the request ready to send (`Prepared`) and what
`Generator.stream()` yields for it: `Token`s, then one `Finished` (the end, holding the last
token), and `KeepAlive` while quiet."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.gateway.tgi.validation import ValidatedParameters
from shared.messages import AdapterRef, FinishReason


@dataclass
class Token:
    """One generated token as the API shows it."""

    index: int  # 1-based position among generated tokens
    id: int
    text: str
    logprob: float | None
    special: bool
    top_tokens: list[Token] = field(default_factory=list)


@dataclass
class Finished:
    """The end of a generation."""

    generated_text: str  # special tokens skipped, cut after a stop string
    finish_reason: FinishReason
    num_generated_tokens: int
    num_input_tokens: int
    seed: int | None  # null for greedy requests
    validation_s: float
    queue_s: float
    inference_s: float
    total_s: float
    prefill: list[Token] = field(default_factory=list)  # prompt tokens, if asked (no `special`)
    stop_sequence: str | None = None  # the stop string that ended it (generated_text's end)
    # the token that ended it, yielded only here; None when the end came without one (a
    # replayed request whose last token was already delivered)
    last_token: Token | None = None

    @property
    def text_before_stop(self) -> str:
        """generated_text without the stop string (OpenAI's contract; TGI keeps it)."""
        if not self.stop_sequence:
            return self.generated_text
        return self.generated_text[: len(self.generated_text) - len(self.stop_sequence)]


class KeepAlive:
    """Yielded when nothing happened for `keepalive_s` (SSE sends a comment)."""


@dataclass
class Prepared:
    """A request ready to send: validated and tokenized."""

    inputs: str
    input_ids: list[int]
    params: ValidatedParameters
    max_new_tokens: int
    arrived_at: float  # unix s the HTTP request arrived
    response_id: str = ""  # the OpenAI answer it is a choice of ("" on TGI routes)
    adapter: AdapterRef | None = None  # the LoRA adapter it selected; None: the base model

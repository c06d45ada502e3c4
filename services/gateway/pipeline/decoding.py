"""One request's text while its token events arrive: incremental detokenizing, the stop
strings, the API tokens (pure)."""

from __future__ import annotations

import math

from services.gateway.pipeline.results import Prepared, Token
from services.gateway.pipeline.stops import StopSequenceMatcher
from services.gateway.pipeline.tokenizer import IncrementalDetokenizer, TextTokenizer
from shared.messages import TokenEvent


def finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


class TextDecoder:
    """Per-request text state: detokenizer, stop matcher, generated text."""

    def __init__(self, tokenizer: TextTokenizer, prepared: Prepared):
        self.tokenizer = tokenizer
        self.detokenizer = IncrementalDetokenizer(tokenizer, prepared.input_ids)
        self.matcher = StopSequenceMatcher(prepared.params.stop)
        self.num_tokens = 0
        self.stop_end: int | None = None

    def token(self, event: TokenEvent, position: int) -> Token:
        token_id = event.token_ids[position]
        self.num_tokens += 1
        tops = event.top_tokens[position] if position < len(event.top_tokens) else []
        top_tokens = [  # decoded where the chosen token is: one id, one text
            Token(
                0,
                top.id,
                self.detokenizer.peek(top.id),
                finite(top.logprob),
                self.tokenizer.is_special(top.id),
            )
            for top in tops
        ]
        text = self.detokenizer.add(token_id)
        is_special = self.tokenizer.is_special(token_id)
        if not is_special and self.stop_end is None:
            self.stop_end = self.matcher.feed(text)
        return Token(
            index=event.index + position if event.index else self.num_tokens,
            id=token_id,
            text=text,
            logprob=finite(event.logprobs[position]) if position < len(event.logprobs) else None,
            special=is_special,
            top_tokens=top_tokens,
        )

    def flush(self) -> str:
        text = self.detokenizer.flush()
        self.matcher.feed(text)
        return text

    @property
    def generated_text(self) -> str:
        text = self.matcher.text
        return text if self.stop_end is None else text[: self.stop_end]

    @property
    def stop_sequence(self) -> str | None:
        """The stop string generated_text ends with, if one ended the generation."""
        return None if self.stop_end is None else self.matcher.matched

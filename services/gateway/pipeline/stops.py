"""Stop-sequence matching on decoded text (pure).

The worker stops on token ids; stop *strings* are matched here, on the text produced so far,
because a string may span several tokens or end inside one. A match counts when it ends in
the newly appended text; the result is the offset right after the stop string, where
generated_text is cut (the stop text itself is kept, as in TGI). The OpenAI routes show the
text without it, and StopHoldback keeps their streams from showing any of it.
"""

from __future__ import annotations

from typing import Protocol


class EndedText(Protocol):
    """What StopHoldback.finish needs of a finished generation."""

    @property
    def text_before_stop(self) -> str: ...


class StopSequenceMatcher:
    def __init__(self, stop_sequences: list[str]):
        self.stop_sequences = [s for s in stop_sequences if s]
        self.tail_length = max((len(s) for s in self.stop_sequences), default=0)
        self.text = ""  # everything fed so far (generated text, special tokens excluded)
        self.matched: str | None = None  # the stop string of the last match returned

    def feed(self, new_text: str) -> int | None:
        """Append text; return the end offset (in the whole text) of the earliest stop match
        that ends inside `new_text`, else None."""
        start = len(self.text)
        self.text += new_text
        if not self.stop_sequences or not new_text:
            return None
        window_start = max(0, start - self.tail_length + 1)
        window = self.text[window_start:]
        best: int | None = None
        for stop in self.stop_sequences:
            found = window.find(stop)
            while found != -1:
                end = window_start + found + len(stop)
                if end > start:
                    if best is None or end < best:
                        best, self.matched = end, stop
                    break
                found = window.find(stop, found + 1)
        return best


class StopHoldback:
    """One choice's streamed text, less what could still become a stop string.

    OpenAI's answers never contain the stop string, and a delta once sent cannot be taken
    back, so the end of the text that is the beginning of some stop string waits until the
    next token says whether the stop matched. `finish` gives the rest of the final text.
    """

    def __init__(self, stop_sequences: list[str]):
        self.stop_sequences = [stop for stop in stop_sequences if stop]
        self.pending = ""  # text received and not yet shown
        self.num_shown = 0  # characters of the generated text shown so far

    def push(self, text: str) -> str:
        """Add a token's text; return the part that can be shown now."""
        self.pending += text
        held = self._num_held()
        shown = self.pending[: len(self.pending) - held]
        self.pending = self.pending[len(shown) :]
        self.num_shown += len(shown)
        return shown

    def finish(self, finished: EndedText) -> str:
        """The rest of the choice's text: up to, never into, the stop string."""
        rest = finished.text_before_stop[self.num_shown :]
        self.num_shown += len(rest)
        self.pending = ""
        return rest

    def _num_held(self) -> int:
        """The longest end of `pending` that some stop string starts with."""
        longest = min(len(self.pending), max((len(s) - 1 for s in self.stop_sequences), default=0))
        for size in range(longest, 0, -1):
            end = self.pending[-size:]
            if any(stop.startswith(end) for stop in self.stop_sequences):
                return size
        return 0

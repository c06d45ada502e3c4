"""Stop-sequence matching on decoded text (pure).

The worker stops on token ids; stop *strings* are matched here, on the text produced so far,
because a string may span several tokens or end inside one. A match counts when it ends in
the newly appended text; the result is the offset right after the stop string, where
generated_text is cut (the stop text itself is kept, as in TGI).
"""

from __future__ import annotations


class StopSequenceMatcher:
    def __init__(self, stop_sequences: list[str]):
        self.stop_sequences = [s for s in stop_sequences if s]
        self.tail_length = max((len(s) for s in self.stop_sequences), default=0)
        self.text = ""  # everything fed so far (generated text, special tokens excluded)

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
                        best = end
                    break
                found = window.find(stop, found + 1)
        return best

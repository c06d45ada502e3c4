"""A one-line progress bar on stderr: redrawn in place on a terminal, printed once per level
otherwise (logs and captured output stay readable). No dependency."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    def __init__(self, label: str, total: int, stream: TextIO | None = None, width: int = 30):
        self.label = label
        self.total = total
        self.done = 0
        self.width = width
        self.stream = stream if stream is not None else sys.stderr
        self.is_live = self.stream.isatty()
        self.started = time.perf_counter()

    def line(self) -> str:
        filled = self.width * self.done // max(self.total, 1)
        bar = "#" * filled + "." * (self.width - filled)
        elapsed = time.perf_counter() - self.started
        return f"{self.label:>16s} [{bar}] {self.done}/{self.total} {elapsed:6.1f}s"

    def advance(self) -> None:
        self.done += 1
        if self.is_live:
            self.stream.write("\r" + self.line())
            self.stream.flush()

    def close(self) -> None:
        self.stream.write(("\r" if self.is_live else "") + self.line() + "\n")
        self.stream.flush()

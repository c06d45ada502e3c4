"""Later attempts of a request: the gateway re-submits a request under the same id with the
next `attempt` when Redis lost some of its tokens (services/gateway/pipeline/resume.py).

A scheduler holding an earlier attempt ends it and runs the later one; the later one waits here
until no step in flight names the id (that step's output belongs to the earlier attempt). A
copy of the same or an earlier attempt than the one held or waiting is refused: the caller
acknowledges its entry.
"""

from __future__ import annotations

from shared.messages import GenerateRequest

Pulled = tuple[GenerateRequest, bytes, str]  # (request, its entry id, its stream)


class LaterAttempts:
    def __init__(self) -> None:
        self._waiting: dict[str, Pulled] = {}  # request id -> the attempt that replaces it

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._waiting

    def __bool__(self) -> bool:
        return bool(self._waiting)

    def __len__(self) -> int:
        return len(self._waiting)

    def entries(self) -> list[tuple[str, bytes]]:
        """(stream, entry id) of each waiting attempt: held by this scheduler too."""
        return [(stream, entry_id) for _, entry_id, stream in self._waiting.values()]

    def refuses(self, message: GenerateRequest, held_attempt: int | None) -> bool:
        """`message` is no later than the attempt held (None: none) or waiting."""
        waiting = self._waiting.get(message.request_id)
        return (held_attempt is not None and held_attempt >= message.attempt) or (
            waiting is not None and waiting[0].attempt >= message.attempt
        )

    def entry_of(self, request_id: str) -> bytes | None:
        """The entry id of the attempt waiting for `request_id` (None: none waits)."""
        waiting = self._waiting.get(request_id)
        return waiting[1] if waiting is not None else None

    def wait(self, pulled: Pulled) -> None:
        self._waiting[pulled[0].request_id] = pulled

    def ready(self, in_flight: set[str] | None = None) -> list[Pulled]:
        """The waiting attempts no step in flight names (None: every one), taken out."""
        names = in_flight or set()
        return [self._waiting.pop(r) for r in list(self._waiting) if r not in names]

    def take_below(self, request_id: str, below_attempt: int) -> Pulled | None:
        """The waiting attempt of `request_id` an abort below `below_attempt` covers (0: any),
        taken out."""
        waiting = self._waiting.get(request_id)
        if waiting is None or (below_attempt and waiting[0].attempt >= below_attempt):
            return None
        return self._waiting.pop(request_id)

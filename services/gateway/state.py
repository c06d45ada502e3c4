"""What the routes share, built once by the app factory and its lifespan (no module globals)."""

from __future__ import annotations

from dataclasses import dataclass, field

import redis.asyncio as aioredis

from services.gateway.chat_template import ChatTemplate
from services.gateway.errors import overloaded
from services.gateway.generation import Generator
from services.gateway.metrics import GatewayMetrics
from services.gateway.replies import ReplyRouter
from services.gateway.tokenizer import TextTokenizer
from services.gateway.validation import Limits
from shared.channels import Channels
from shared.settings import Settings


class Admission:
    """The per-gateway concurrency gate (TGI's max_concurrent_requests semaphore, no waiting)."""

    def __init__(self, limit: int):
        self.limit = limit
        self.num_in_flight = 0

    def try_acquire(self, num: int = 1) -> bool:
        if self.num_in_flight + num > self.limit:
            return False
        self.num_in_flight += num
        return True

    def release(self, num: int = 1) -> None:
        self.num_in_flight = max(0, self.num_in_flight - num)

    def hold(self, num: int) -> Held:
        """`num` slots at once, or none: raises 429 overloaded."""
        if not self.try_acquire(num):
            raise overloaded()
        return Held(self, num)


class Held:
    """Slots taken from an Admission; `release` gives them back once, however often called."""

    def __init__(self, admission: Admission, num: int):
        self.admission = admission
        self.num = num

    def release(self) -> None:
        if self.num:
            self.admission.release(self.num)
            self.num = 0


@dataclass
class GatewayState:
    settings: Settings
    limits: Limits
    tokenizer: TextTokenizer
    channels: Channels
    gateway_id: str
    metrics: GatewayMetrics
    admission: Admission
    chat_template: ChatTemplate | None = None  # None: the model has none (chat answers 422)
    compute_type: str = "gpu+optimized"
    version: str = "0.1.0"
    # set by the lifespan once the event loop runs
    client: aioredis.Redis | None = None
    router: ReplyRouter | None = None
    generator: Generator | None = None
    extra: dict = field(default_factory=dict)

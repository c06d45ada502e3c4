"""What the routes share, built once by the app factory and its lifespan (no module globals)."""

from __future__ import annotations

from dataclasses import dataclass, field

import redis.asyncio as aioredis

from services.gateway.metrics import GatewayMetrics
from services.gateway.pipeline.admission import Admission
from services.gateway.pipeline.chat_template import ChatTemplate
from services.gateway.pipeline.generation import Generator
from services.gateway.pipeline.replies import ReplyRouter
from services.gateway.pipeline.tokenizer import TextTokenizer
from services.gateway.tgi.validation import Limits
from shared.adapters import AdapterRegistry
from shared.channels import Channels
from shared.messages import AdapterRef
from shared.settings import Settings


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
    startup_adapters: list[AdapterRef] = field(default_factory=list)  # --lora-adapters, checked
    # set by the lifespan once the event loop runs
    client: aioredis.Redis | None = None
    router: ReplyRouter | None = None
    generator: Generator | None = None

    def redis(self) -> aioredis.Redis:
        """The Redis client; routes only run once the lifespan connected it."""
        assert self.client is not None, "the app's lifespan sets the Redis client"
        return self.client

    def generations(self) -> Generator:
        """The Generator; routes only run once the lifespan built it."""
        assert self.generator is not None, "the app's lifespan builds the Generator"
        return self.generator

    def adapters(self) -> AdapterRegistry:
        """The LoRA adapter registry every gateway shares (in Redis)."""
        return AdapterRegistry(self.redis(), self.channels)

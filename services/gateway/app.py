"""The gateway's FastAPI app: `create_app(settings)`.

The factory loads the tokenizer and resolves limits (so a bad model folder fails at start-up);
the lifespan connects Redis, starts the single reply subscription and builds the Generator.
Redis being down does not stop the app: generation answers 503 and the subscription retries.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
from importlib import metadata

from fastapi import FastAPI
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from services.gateway.metrics import GatewayMetrics
from services.gateway.openai import models as openai_models
from services.gateway.openai import routes as openai_routes
from services.gateway.openapi.routes import describe_routes
from services.gateway.pipeline.adapters import register_startup
from services.gateway.pipeline.chat_template import ChatTemplate
from services.gateway.pipeline.generation import Generator
from services.gateway.pipeline.replies import ReplyRouter
from services.gateway.pipeline.tokenizer import TextTokenizer
from services.gateway.state import Admission, GatewayState
from services.gateway.tgi import compat as compat_routes
from services.gateway.tgi import info as info_routes
from services.gateway.tgi import routes as tgi_routes
from services.gateway.tgi.validation import Limits
from shared.adapters import startup_refs
from shared.channels import Channels
from shared.master_watch import MasterWatch
from shared.model_files import TOKENIZER_FILES, context_length, resolve_model_dir
from shared.redis_connect import client_for, redact_url
from shared.settings import Settings

log = logging.getLogger(__name__)


def package_version() -> str:
    try:
        return metadata.version("textgen")
    except metadata.PackageNotFoundError:
        return "0.1.0"


def build_state(settings: Settings) -> GatewayState:
    folder = resolve_model_dir(settings.model_id, settings.revision, TOKENIZER_FILES)
    tokenizer = TextTokenizer.from_folder(folder)
    max_input, max_total = settings.resolved_limits(context_length(folder))
    limits = Limits(
        max_input_tokens=max_input,
        max_total_tokens=max_total,
        max_best_of=settings.max_best_of,
        max_stop_sequences=settings.max_stop_sequences,
        max_top_n_tokens=settings.max_top_n_tokens,
    )
    return GatewayState(
        settings=settings,
        limits=limits,
        tokenizer=tokenizer,
        channels=Channels(settings.namespace),
        gateway_id=settings.gateway_id or secrets.token_hex(8),
        metrics=GatewayMetrics(max_input, max_total),
        admission=Admission(settings.max_concurrent_requests),
        chat_template=ChatTemplate.from_folder(folder, tokenizer.config),
        compute_type=os.environ.get("COMPUTE_TYPE", "gpu+optimized"),
        version=package_version(),
        # checked now: a bad --lora-adapters stops the gateway before it serves
        startup_adapters=startup_refs(settings),
    )


def create_app(settings: Settings) -> FastAPI:
    state = build_state(settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        if not settings.has_redis:
            raise RuntimeError("the gateway needs --redis-url or --redis-sentinels")
        # every request in flight may hold a connection at once (its XADD, then its abort)
        state.client = client_for(settings, 2 * settings.max_concurrent_requests + 16)
        # fail fast while Redis is down (503 at once, not after redis-py's backoff); one retry
        # still replaces a pooled connection that died with a restarted Redis
        state.client.set_retry(Retry(NoBackoff(), 1))
        master = MasterWatch.for_settings(
            settings, [state.client], on_switch=state.metrics.redis_master_switched
        ).start()
        state.router = ReplyRouter(
            state.client,
            state.channels.reply(state.gateway_id),
            resume=settings.redis_resume_timeout > 0,
            on_epoch_change=state.metrics.redis_epoch_changed,
            master=master,
            on_replaced_attempt_event=state.metrics.replaced_attempt_event_dropped,
        )
        state.generator = Generator(
            state.client,
            state.router,
            state.tokenizer,
            state.channels,
            state.metrics,
            settings.request_timeout,
            settings.max_queue_length,
            settings.max_queue_wait,
            settings.redis_resume_timeout,
            settings.redis_wait_replicas,
        )
        await state.router.start()
        registering = None
        if state.startup_adapters:
            registering = asyncio.create_task(register_startup(state, state.startup_adapters))
        if not await state.router.wait_subscribed(timeout=2.0):
            log.warning(
                "Redis at %s unreachable; answering 503 until it is back",
                redact_url(settings.redis_url or settings.redis_sentinels or ""),
            )
        log.info(
            "gateway %s ready: model %s, limits %s",
            state.gateway_id,
            settings.model_id,
            state.limits,
        )
        try:
            yield
        finally:
            if registering is not None:
                registering.cancel()
            await state.generator.drain()
            await state.router.stop()
            await master.stop()
            await state.client.aclose()

    app = FastAPI(title="textgen", version=state.version, lifespan=lifespan)
    app.state.gateway = state
    app.include_router(tgi_routes.router)
    app.include_router(info_routes.router)
    app.include_router(openai_routes.router)
    app.include_router(openai_models.router)
    app.include_router(compat_routes.router)
    describe_routes(app)
    return app

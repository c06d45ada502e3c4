"""Which LoRA adapter a request selects, read from the registry every gateway shares
(shared/adapters.py): OpenAI's `model`, TGI's `parameters.adapter_id`.

    selector                         registered       not registered
    absent, "tgi", the base model    -                the base model
    OpenAI `model`                   that adapter     404 model_not_found while any adapter is
                                                      registered; else the base model (TGI)
    TGI `adapter_id`                 that adapter     the base model (TGI's behaviour), logged
                                                      and counted

One HGET per request that names something other than the base model; none otherwise.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from services.gateway.pipeline.errors import GatewayError, unavailable
from shared.adapters import base_model_names
from shared.bus import REDIS_ERRORS
from shared.messages import AdapterRef

if TYPE_CHECKING:
    from services.gateway.state import GatewayState

log = logging.getLogger(__name__)


def base_names(state: GatewayState) -> tuple[str, ...]:
    return base_model_names(state.settings.model_id)


def model_not_found(name: str) -> GatewayError:
    """404 for an OpenAI `model` that is neither the base model nor an adapter (vLLM's words)."""
    return GatewayError(
        404, f"The model `{name}` does not exist.", "model_not_found", param="model"
    )


async def resolve(state: GatewayState, name: str | None, strict: bool) -> AdapterRef | None:
    """The adapter `name` selects (None: the base model). `strict`: an unknown name is a 404
    while adapters are served (OpenAI routes); else it runs the base model (TGI's routes)."""
    if name is None or name in base_names(state):
        return None
    registry = state.adapters()
    try:
        ref = await registry.get(name)
        served = strict and ref is None and await registry.count() > 0
    except REDIS_ERRORS as exc:
        raise unavailable(f"the LoRA adapter registry is unreachable: {exc}") from exc
    if ref is not None:
        state.metrics.num_adapter_requests[name] += 1
        return ref
    if served:
        state.metrics.num_unknown_adapters += 1
        raise model_not_found(name)
    if not strict:
        state.metrics.num_unknown_adapters += 1
        log.info("adapter_id %r is not registered: the base model answers (as TGI)", name)
    return None


async def register_startup(state: GatewayState, refs: list[AdapterRef]) -> None:
    """Register --lora-adapters once Redis answers (retried each second until it does)."""
    while True:
        try:
            await state.adapters().register_startup(refs)
            log.info("LoRA adapters registered: %s", ", ".join(r.name for r in refs))
            return
        except REDIS_ERRORS as exc:
            log.warning("registering LoRA adapters failed (%s); retrying", exc)
            await asyncio.sleep(1.0)

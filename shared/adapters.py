"""The LoRA adapter registry: which adapters clients may select, shared by every service.

The set lives in one Redis hash (`{textgen}:adapters`, name -> AdapterRef), so every gateway
replica accepts the same names and a request carries its adapter's folder to whichever worker
group runs it. Adapters enter at start-up (`--lora-adapters NAME=FOLDER,...`, TGI's
`LORA_ADAPTERS`) or at run time (`POST /v1/load_lora_adapter`), and leave with
`/v1/unload_lora_adapter`; workers drop what left the registry (services/worker/lora.py).

Registering reads the folder's `adapter_config.json` (PEFT's format) and refuses what plain
LoRA cannot serve: other PEFT methods, DoRA, trained biases, saved whole modules, ranks above
`--max-lora-rank`. The weights are read by the worker that loads it. No torch here.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from shared.bus import as_bytes
from shared.channels import Channels
from shared.codec import decode, encode
from shared.messages import AdapterRef
from shared.settings import Settings

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,127}$")


def base_model_names(model_id: str) -> tuple[str, ...]:
    """What selects the base model, so no adapter may be named so: nothing, TGI's "tgi", the
    served model's id."""
    return ("", "tgi", model_id)


class AdapterError(ValueError):
    """An adapter that cannot be registered, with the reason for the client or operator."""

    code = "invalid_adapter"  # the machine tag of the cause, in OpenAI's error `code`

    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.code = code or self.code


def parse_lora_adapters(text: str | None) -> list[tuple[str, str]]:
    """`NAME=FOLDER,...` (a bare FOLDER is named by itself, as TGI names hub ids) as
    [(name, folder)]. Raises AdapterError on a malformed item or a repeated name."""
    pairs: list[tuple[str, str]] = []
    for item in (text or "").split(","):
        item = item.strip()
        if not item:
            continue
        if item.count("=") > 1:
            raise AdapterError(f"invalid LoRA adapter {item!r}: expected NAME=FOLDER")
        name, _, path = item.rpartition("=")
        name = name.strip() or path.strip()
        pairs.append((name, path.strip()))
    names = [name for name, _ in pairs]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise AdapterError(f"LoRA adapter names given twice: {', '.join(repeated)}")
    return pairs


def check_name(name: str, reserved: tuple[str, ...] = ()) -> None:
    if not NAME_PATTERN.match(name):
        raise AdapterError(
            f"invalid LoRA adapter name {name!r}: 1-128 letters, digits and ._:/@+- "
            "starting with a letter or digit"
        )
    if name in reserved:
        raise AdapterError(f"{name!r} names the base model; pick another adapter name")


def read_config(path: str, max_rank: int) -> dict[str, Any]:
    """The folder's adapter_config.json, checked for what plain LoRA serves."""
    folder = Path(path)
    config_file = folder / CONFIG_FILE
    if not config_file.is_file():
        raise AdapterError(f"no {CONFIG_FILE} in {path!r} (adapters load from local folders)")
    if not (folder / WEIGHTS_FILE).is_file():
        raise AdapterError(f"no {WEIGHTS_FILE} in {path!r} (save the adapter as safetensors)")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise AdapterError(f"{config_file} is not readable JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise AdapterError(f"{config_file} is not a JSON object")
    refusals = {
        "peft_type": (config.get("peft_type", "LORA") != "LORA", "it is not a LoRA adapter"),
        "use_dora": (bool(config.get("use_dora")), "DoRA adapters are not supported"),
        "bias": (
            config.get("bias", "none") != "none",
            "adapters with trained biases are not supported",
        ),
        "lora_bias": (bool(config.get("lora_bias")), "adapters with LoRA biases are not supported"),
        "modules_to_save": (
            bool(config.get("modules_to_save")),
            "adapters that save whole modules (modules_to_save) are not supported",
        ),
    }
    for key, (refused, why) in refusals.items():
        if refused:
            raise AdapterError(f"{path!r}: {why} ({key}={config.get(key)!r})")
    rank = config_rank(config)
    if rank > max_rank:
        raise AdapterError(f"{path!r}: LoRA rank {rank} is above --max-lora-rank {max_rank}")
    return config


def config_rank(config: dict[str, Any]) -> int:
    """The largest rank a PEFT LoRA config gives any module (r, else rank_pattern's)."""
    pattern = config.get("rank_pattern") or {}
    ranks = [int(config.get("r", 8))] + [int(r) for r in pattern.values()]
    if min(ranks) <= 0:
        raise AdapterError(f"LoRA ranks must be positive, not {min(ranks)}")
    return max(ranks)


def make_ref(name: str, path: str, max_rank: int, reserved: tuple[str, ...] = ()) -> AdapterRef:
    """A new registration of the adapter in `path` (checked: see read_config)."""
    check_name(name, reserved)
    config = read_config(path, max_rank)
    return AdapterRef(
        name=name,
        path=str(Path(path).resolve()),
        id=uuid.uuid4().hex[:16],
        rank=config_rank(config),
        base_model=str(config.get("base_model_name_or_path") or ""),
        created=int(time.time()),
    )


class AdapterRegistry:
    """The registry hash, read and written by gateways (requests, the load/unload routes) and
    by any service started with --lora-adapters."""

    def __init__(self, redis: aioredis.Redis, channels: Channels) -> None:
        self.redis = redis
        self.key = channels.adapters

    async def get(self, name: str) -> AdapterRef | None:
        data = await self.redis.hget(self.key, name)
        return decode(as_bytes(data), AdapterRef) if data is not None else None

    async def all(self) -> list[AdapterRef]:
        entries = await self.redis.hgetall(self.key)
        return sorted(
            (decode(as_bytes(v), AdapterRef) for v in entries.values()), key=lambda r: r.name
        )

    async def count(self) -> int:
        return int(await self.redis.hlen(self.key))

    async def add(self, ref: AdapterRef) -> bool:
        """Register `ref` unless its name is taken: False then."""
        return bool(await self.redis.hsetnx(self.key, ref.name, encode(ref)))

    async def remove(self, name: str) -> bool:
        """Unregister `name`; False when it was not registered."""
        return bool(await self.redis.hdel(self.key, name))

    async def register_startup(self, refs: list[AdapterRef]) -> None:
        """Register the start-up adapters: a name already
        registered for the same folder keeps its registration (every service started with the
        flag registers the same list), one registered for another folder is replaced."""
        for ref in refs:
            if await self.add(ref):
                continue
            held = await self.get(ref.name)
            if held is None or held.path != ref.path:
                await self.redis.hset(self.key, ref.name, encode(ref))


def startup_refs(settings: Settings) -> list[AdapterRef]:
    """--lora-adapters as checked registrations; raises AdapterError on the first bad one.
    The launcher, the gateway and the worker each check them at start."""
    reserved = base_model_names(settings.model_id)
    return [
        make_ref(name, path, settings.max_lora_rank, reserved)
        for name, path in parse_lora_adapters(settings.lora_adapters)
    ]

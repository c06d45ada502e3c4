"""Configuration, read once at start-up and passed down.

Flag and environment names keep TGI's where TGI has them (`--model-id` / `MODEL_ID`,
`--max-batch-prefill-tokens` / `MAX_BATCH_PREFILL_TOKENS`, ...). Every service reads the same
`Settings`; each uses the fields it needs. Command-line flags are generated from the fields
(`max_batch_size` -> `--max-batch-size`); a flag wins over the environment, which wins over the
default.
"""

from __future__ import annotations

import argparse
import typing
from typing import Any, Literal

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from shared.openmp import parse_cpus

# --quantize values (TGI's names): bitsandbytes int8/nf4/fp4 quantize while loading; gptq and
# awq load checkpoints quantized ahead of time
QUANTIZE_METHODS = ("bitsandbytes", "bitsandbytes-nf4", "bitsandbytes-fp4", "gptq", "awq")


# tokens per step when --max-batch-prefill-tokens is not given and the worker suggests none:
# TGI's 4096 on accelerators; on a CPU a step of 4096 prompt tokens can take seconds and every
# prompt in it waits for its end (SmolLM2-135M, float32, 2 cores, 32 prompts of 128 tokens:
# TTFT p50 4.48 s at 4096, 1.82 s at 512, the same output throughput). CPU workers suggest a
# budget for their measured speed (services/worker/step_budget.py)
DEFAULT_STEP_TOKENS = {"cpu": 512}
DEFAULT_ACCELERATOR_STEP_TOKENS = 4096


def step_tokens(configured: int | None, device: str, suggested: int = 0) -> int:
    """The step budget of a worker group on `device` ("cpu", "cuda:0", ...): the flag's, else
    the one the worker suggested, else the device's default."""
    if configured:
        return configured
    if suggested:
        return suggested
    return DEFAULT_STEP_TOKENS.get(device.split(":")[0], DEFAULT_ACCELERATOR_STEP_TOKENS)


def parse_cuda_graphs(text: str | None) -> list[int] | None:
    """--cuda-graphs: "1,2,4" -> [1, 2, 4]; "0" -> [] (none); None -> None (the default)."""
    if text is None:
        return None
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        message = f"cuda_graphs must be batch sizes like 1,2,4,8 or 0, not {text!r}"
        raise ValueError(message) from None
    if sizes == [0]:
        return []
    if not sizes or any(size <= 0 for size in sizes):
        raise ValueError(f"cuda_graphs must be positive batch sizes or 0, not {text!r}")
    return sorted(set(sizes))


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="", extra="ignore", populate_by_name=True)

    # --- shared -----------------------------------------------------------------------------
    redis_url: str | None = Field(
        None,
        description="Redis URL; `launch` starts one when unset (with --redis-sentinels, only "
        "its user, password and db are used)",
    )
    redis_sentinels: str | None = Field(
        None,
        description="Redis Sentinel addresses, host:port,...: every service follows the master "
        "they name (--redis-sentinel-master) through failovers",
    )
    redis_sentinel_master: str = Field(
        "mymaster", description="the master's name in Sentinel (`sentinel monitor NAME ...`)"
    )
    redis_cluster: bool = Field(
        False,
        description="--redis-url names a node of a Redis Cluster (or a cluster-mode managed "
        "Redis): every service uses a cluster client",
    )
    namespace: str = Field("textgen", description="prefix of every Redis key and channel")
    model_id: str = Field(
        "HuggingFaceTB/SmolLM2-135M-Instruct", description="hub id or local model folder"
    )
    revision: str | None = Field(None, description="hub revision of the model")
    log_level: str = Field("INFO", description="DEBUG, INFO, WARNING, ERROR")
    json_output: bool = Field(False, description="log as JSON lines")
    otlp_endpoint: str | None = Field(None, description="OpenTelemetry OTLP endpoint for traces")

    # --- request limits (gateway validates, scheduler enforces) ------------------------------
    max_input_tokens: int | None = Field(None, description="default: max_total_tokens - 1")
    max_total_tokens: int | None = Field(
        None, description="prompt + new tokens per request; default: min(model context, 4096)"
    )
    max_concurrent_requests: int = Field(128, description="in-flight requests per gateway")
    max_best_of: int = 2
    max_stop_sequences: int = 4
    max_top_n_tokens: int = 5
    max_client_batch_size: int = 4
    payload_limit: int = Field(2_000_000, description="largest accepted request body, bytes")
    request_timeout: float = Field(600.0, description="seconds before a request is abandoned")
    claim_timeout: float = Field(
        10.0, description="seconds before another scheduler takes over a silent one's requests"
    )
    max_restarts: int = Field(5, description="launch: restarts of a dead child before giving up")
    shutdown_grace: float = Field(
        30.0, description="seconds SIGTERM lets open streams and running requests finish"
    )
    max_queue_length: int = Field(10_000, description="requests waiting in the stream; 429 beyond")
    max_queue_wait: float | None = Field(
        None, description="seconds a request may wait for a worker before a 503 (default: none)"
    )
    redis_wait_replicas: int = Field(
        0,
        description="replicas that must have a request before it is accepted (Redis WAIT, "
        "sent with its XADD); 0: none. With Sentinel and 2 replicas, 1",
    )
    redis_resume_timeout: float = Field(
        30.0,
        description="seconds a request in flight waits for Redis to come back when its token "
        "events are lost (restart, failover), then continues where it stopped; 0: it fails at "
        "once",
    )

    # --- gateway ----------------------------------------------------------------------------
    # env TEXTGEN_HOSTNAME, not HOSTNAME: Docker and Kubernetes set HOSTNAME to the container name
    hostname: str = "0.0.0.0"
    port: int = 3000
    gateway_id: str | None = Field(None, description="reply channel suffix; random when unset")
    api_key: str | None = None
    disable_grammar_support: bool = Field(
        False, description="refuse grammars, response_format schemas and forced tools (TGI's)"
    )
    tool_call_parser: Literal["auto", "hermes", "mistral", "llama3_json"] = Field(
        "auto",
        description="how `tool_choice: auto` reads calls in the model's text: hermes "
        "(<tool_call>JSON</tool_call>), llama3_json, mistral ([TOOL_CALLS]), or auto (from the "
        "chat template)",
    )

    # --- scheduler --------------------------------------------------------------------------
    group: str = Field("0", description="worker group driven by this scheduler/worker")
    max_batch_prefill_tokens: int | None = Field(
        None,
        description="tokens computed per step (prompt chunks and decodes; a prompt whose rest "
        "is at most a sixteenth past it finishes in the step); default: 4096 on a "
        "GPU; on a CPU the worker's suggestion, the power of two from 512 to 4096 nearest "
        "below what its matmuls compute in 0.5 s (a prompt waits for its whole step)",
    )
    max_batch_total_tokens: int | None = Field(
        None, description="KV-cache capacity in tokens; default: from the worker's memory budget"
    )
    max_batch_size: int = Field(256, description="requests per step")
    waiting_served_ratio: float = Field(
        0.3,
        description="accepted for compatibility with TGI (and shown in /info); changes nothing: "
        "chunked prefill admits waiting requests into every step's token budget",
    )
    max_waiting_tokens: int = Field(
        20,
        description="accepted for compatibility with TGI (and shown in /info); changes nothing: "
        "chunked prefill admits waiting requests into every step's token budget",
    )
    block_size: int = Field(16, description="tokens per KV-cache block")
    disable_prefix_caching: bool = Field(
        False, description="do not reuse KV blocks of equal prompt prefixes"
    )
    metrics_port: int | None = Field(None, description="Prometheus port of scheduler/worker")

    # --- worker -----------------------------------------------------------------------------
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    device: str | None = Field(None, description="cpu, cuda, cuda:1; default: cuda if available")
    kv_cache_memory: int | None = Field(
        None, description="bytes for the KV cache; default: a share of free memory"
    )
    num_shard: int = Field(1, description="tensor-parallel ranks in the worker group")
    quantize: Literal[QUANTIZE_METHODS] | None = Field(  # type: ignore[valid-type]
        None, description="quantize while loading (bitsandbytes*) or load a gptq/awq checkpoint"
    )
    trust_remote_code: bool = False
    grammar_compile_timeout: float = Field(
        10.0, description="seconds a request's grammar may take to build before it fails"
    )
    speculate: int = Field(
        0, description="tokens proposed per step by n-gram prompt lookup (greedy requests)"
    )
    disable_cpu_kernels: bool = Field(
        False,
        description="on the CPU, run transformers' own modules instead of textgen's fast "
        "decoder for Llama, Mistral and Qwen2 models",
    )
    lora_adapters: str | None = Field(
        None,
        description="LoRA adapters to serve, NAME=FOLDER,... (or FOLDER, named by itself): PEFT "
        "folders (adapter_config.json, adapter_model.safetensors), registered in Redis at start",
    )
    max_loras: int = Field(
        4, description="LoRA adapters a worker group holds at once, and the most one step mixes"
    )
    max_lora_rank: int = Field(64, description="largest LoRA rank accepted when registering")
    cuda_graphs: str | None = Field(
        None,
        description="TGI's: decode batch sizes to capture as CUDA graphs, e.g. 1,2,4,8,16,32; "
        "0: none (every step eager); default: 1, 2, 4, 8, then every 16 up to "
        "--max-batch-size",
    )
    disable_compile: bool = Field(
        False,
        description="on CUDA, run transformers' modules as they are in the decode graphs and "
        "eager steps instead of under torch.compile (a faster start, slower steps)",
    )
    fake_step_ms: float | None = Field(
        None, description="simulate the worker: each step takes this long, no model is loaded"
    )

    # --- launcher ---------------------------------------------------------------------------
    num_groups: int = Field(
        1, description="worker groups `textgen launch` starts (a scheduler and a worker each)"
    )
    worker_cpus: str | None = Field(
        None,
        description="launch on a CPU host: the CPUs the workers' forward passes run on (e.g. "
        "0-5), as in taskset -c; the gateway, schedulers, embedded Redis and the workers' "
        "event loops get the others, so they never preempt a forward pass (default: every "
        "service shares every CPU)",
    )

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        env_vars = getattr(env_settings, "env_vars", None)
        if isinstance(env_vars, dict):
            env_vars.pop("hostname", None)
            if "textgen_hostname" in env_vars:
                env_vars["hostname"] = env_vars["textgen_hostname"]
        return init_settings, env_settings, dotenv_settings, file_secret_settings

    @property
    def has_redis(self) -> bool:
        """A Redis to connect to is configured (--redis-url or --redis-sentinels)."""
        return bool(self.redis_url or self.redis_sentinels)

    @model_validator(mode="after")
    def _check(self) -> Settings:
        if self.max_batch_size <= 0:
            raise ValueError("max_batch_size must be > 0")
        if self.block_size <= 0:
            raise ValueError("block_size must be > 0")
        if self.num_groups <= 0:
            raise ValueError("num_groups must be > 0")
        if self.worker_cpus is not None:
            parse_cpus(self.worker_cpus)  # raises ValueError with the reason
        if not 0 <= self.speculate <= 16:
            raise ValueError("speculate must be between 0 and 16")
        if self.max_loras <= 0:
            raise ValueError("max_loras must be > 0")
        if self.max_lora_rank <= 0:
            raise ValueError("max_lora_rank must be > 0")
        if self.cuda_graphs is not None:
            parse_cuda_graphs(self.cuda_graphs)  # raises ValueError with the reason
        if self.redis_sentinels is not None:
            from shared.redis_connect import sentinel_addresses

            sentinel_addresses(self.redis_sentinels)  # raises ValueError with the reason
        if self.redis_cluster and (self.redis_sentinels or not self.redis_url):
            raise ValueError("redis_cluster needs --redis-url (a cluster node) and no sentinels")
        if "{" in self.namespace or "}" in self.namespace:
            raise ValueError("namespace must not hold { or } (key names add their hash tags)")
        if self.redis_wait_replicas < 0:
            raise ValueError("redis_wait_replicas must be >= 0")
        if self.redis_resume_timeout < 0:
            raise ValueError("redis_resume_timeout must be >= 0")
        if self.grammar_compile_timeout <= 0:
            raise ValueError("grammar_compile_timeout must be positive")
        if (
            self.max_input_tokens is not None
            and self.max_total_tokens is not None
            and self.max_input_tokens >= self.max_total_tokens
        ):
            raise ValueError("max_input_tokens must be < max_total_tokens")
        return self

    def resolved_limits(self, model_context: int) -> tuple[int, int]:
        """(max_input_tokens, max_total_tokens) given the model's context length."""
        max_total = self.max_total_tokens or min(model_context, 4096)
        max_input = self.max_input_tokens or max_total - 1
        return max_input, max_total


def _flag_type(annotation: Any) -> Any:
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    base = args[0] if args else annotation
    if typing.get_origin(base) is Literal:
        return str
    if base is bool:
        return lambda text: text.lower() in ("1", "true", "yes", "on")
    return base if base in (int, float, str) else str


def add_settings_flags(parser: argparse.ArgumentParser) -> None:
    """Add one `--kebab-case` flag per Settings field. Unset flags stay absent, so the
    environment and the defaults still apply."""
    for name, field in Settings.model_fields.items():
        flag = "--" + name.replace("_", "-")
        kwargs: dict[str, Any] = {"dest": name, "default": argparse.SUPPRESS}
        if field.annotation is bool:
            kwargs["action"] = "store_const"
            kwargs["const"] = True
        else:
            kwargs["type"] = _flag_type(field.annotation)
        parser.add_argument(flag, help=field.description or "", **kwargs)


def describe_invalid(exc: Exception) -> str:
    """A settings error without the values given (they may hold a password)."""
    errors = getattr(exc, "errors", None)
    if not callable(errors):
        return type(exc).__name__
    return "; ".join(
        f"{'.'.join(str(part) for part in error['loc']) or 'settings'}: {error['msg']}"
        for error in errors(include_input=False, include_url=False)
    )


def settings_from_args(args: argparse.Namespace) -> Settings:
    """Settings from parsed flags, falling back to the environment and defaults."""
    explicit = {k: v for k, v in vars(args).items() if k in Settings.model_fields}
    return Settings(**explicit)

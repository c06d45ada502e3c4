"""Prometheus metrics with TGI's names, on a per-app registry.

TGI exports counters without the `_total` suffix that prometheus_client appends, so counters
are kept here as plain numbers and rendered by hand; histograms and gauges use
prometheus_client on the app's own registry.
"""

from __future__ import annotations

from collections import Counter

from prometheus_client import Gauge, Histogram, generate_latest

from shared.telemetry import new_registry

DURATION_BUCKETS = [0.00015 * 1.5**i for i in range(35)]
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def linear_buckets(maximum: int, count: int = 100) -> list[float]:
    step = max(maximum / count, 1.0)
    return sorted({round(step * (i + 1), 3) for i in range(count)})


class GatewayMetrics:
    def __init__(self, max_input_tokens: int, max_total_tokens: int):
        self.registry = new_registry()
        self.num_requests = 0
        self.num_success = 0
        self.num_failures: Counter[str] = Counter()
        self.num_unauthorized = 0  # requests refused for a missing or wrong --api-key
        self.num_constrained: Counter[str] = Counter()  # constrained requests by kind
        self.num_tool_calls: Counter[str] = Counter()  # tool calls answered by tool_choice mode
        self.num_adapter_requests: Counter[str] = Counter()  # requests admitted per LoRA adapter
        self.num_unknown_adapters = 0  # requests naming an adapter nobody registered
        self.num_routed_adapter_requests = 0  # sent to the group holding their adapter
        self.num_resumed_requests = 0  # re-submitted after Redis lost their token events
        self.num_replaced_attempt_events = 0  # late events of a replaced attempt, past a gap
        self.num_unreplicated = 0  # accepted before --redis-wait-replicas replicas had them
        self.num_redis_epoch_changes = 0  # Redis restarted or failed over under this gateway
        # new masters the sentinels named, or new primaries of a cluster's slots
        # (shared/master_watch)
        self.num_redis_master_switches = 0

        def histogram(name: str, doc: str, buckets: list[float]) -> Histogram:
            return Histogram(name, doc, buckets=buckets, registry=self.registry)

        self.duration = histogram("tgi_request_duration", "end-to-end seconds", DURATION_BUCKETS)
        self.validation_duration = histogram(
            "tgi_request_validation_duration", "arrival to enqueued, s", DURATION_BUCKETS
        )
        self.queue_duration = histogram(
            "tgi_request_queue_duration", "enqueued to scheduled, s", DURATION_BUCKETS
        )
        self.inference_duration = histogram(
            "tgi_request_inference_duration", "scheduled to done, s", DURATION_BUCKETS
        )
        self.time_per_token = histogram(
            "tgi_request_mean_time_per_token_duration", "inference s per token", DURATION_BUCKETS
        )
        self.input_length = histogram(
            "tgi_request_input_length", "prompt tokens", linear_buckets(max_input_tokens)
        )
        self.generated_tokens = histogram(
            "tgi_request_generated_tokens", "generated tokens", linear_buckets(max_total_tokens)
        )
        self.max_new_tokens = histogram(
            "tgi_request_max_new_tokens", "max_new_tokens", linear_buckets(max_total_tokens)
        )
        self.queue_size = Gauge(
            "tgi_queue_size",
            "requests of this gateway waiting to be scheduled",
            registry=self.registry,
        )
        self.openai_generations = Histogram(
            "textgen_openai_generations",
            "generations one OpenAI request runs: its prompts times max(n, best_of)",
            ["route"],
            buckets=[1, 2, 4, 8, 16, 32, 64, 128, 256, 512],
            registry=self.registry,
        )
        self.intake_wait = Histogram(
            "textgen_intake_wait_seconds",
            "a request's XADD until --redis-wait-replicas replicas have it (WAIT)",
            buckets=[0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5],
            registry=self.registry,
        )
        self.batch_current_size = Gauge(
            "tgi_batch_current_size",
            "requests of this gateway being generated",
            registry=self.registry,
        )

    def request_started(self) -> None:
        self.num_requests += 1

    def request_failed(self, label: str) -> None:
        self.num_failures[label] += 1

    def request_unauthorized(self) -> None:
        self.num_unauthorized += 1

    def request_succeeded(
        self,
        *,
        total_s: float,
        validation_s: float,
        queue_s: float,
        inference_s: float,
        num_input_tokens: int,
        num_generated_tokens: int,
    ) -> None:
        self.num_success += 1
        self.duration.observe(total_s)
        self.validation_duration.observe(validation_s)
        self.queue_duration.observe(queue_s)
        self.inference_duration.observe(inference_s)
        if num_generated_tokens:
            self.time_per_token.observe(inference_s / num_generated_tokens)
        self.input_length.observe(num_input_tokens)
        self.generated_tokens.observe(num_generated_tokens)

    def replaced_attempt_event_dropped(self) -> None:
        self.num_replaced_attempt_events += 1

    def redis_epoch_changed(self) -> None:
        self.num_redis_epoch_changes += 1

    def redis_master_switched(self) -> None:
        self.num_redis_master_switches += 1

    def render(self) -> bytes:
        lines = [
            "# HELP tgi_request_count requests entering a generation handler",
            "# TYPE tgi_request_count counter",
            f"tgi_request_count {self.num_requests}",
            "# HELP tgi_request_success generations that reached their final token",
            "# TYPE tgi_request_success counter",
            f"tgi_request_success {self.num_success}",
            "# HELP tgi_request_failure failed requests by cause",
            "# TYPE tgi_request_failure counter",
        ]
        for label in sorted(self.num_failures):
            lines.append(f'tgi_request_failure{{err="{label}"}} {self.num_failures[label]}')
        lines += [
            "# HELP textgen_unauthorized_requests requests refused for a missing or wrong key",
            "# TYPE textgen_unauthorized_requests counter",
            f"textgen_unauthorized_requests {self.num_unauthorized}",
            "# HELP textgen_constrained_requests requests admitted with a constraint, by kind",
            "# TYPE textgen_constrained_requests counter",
        ]
        for kind in sorted(self.num_constrained):
            lines.append(
                f'textgen_constrained_requests{{kind="{kind}"}} {self.num_constrained[kind]}'
            )
        lines += [
            "# HELP textgen_tool_calls tool calls answered, by tool_choice mode",
            "# TYPE textgen_tool_calls counter",
        ]
        for mode in sorted(self.num_tool_calls):
            lines.append(f'textgen_tool_calls{{mode="{mode}"}} {self.num_tool_calls[mode]}')
        lines += [
            "# HELP textgen_adapter_requests requests that selected a LoRA adapter, by adapter",
            "# TYPE textgen_adapter_requests counter",
        ]
        for name in sorted(self.num_adapter_requests):
            count = self.num_adapter_requests[name]
            lines.append(f'textgen_adapter_requests{{adapter="{name}"}} {count}')
        lines += [
            "# HELP textgen_unknown_adapter_requests requests naming an unregistered adapter "
            "(404 on OpenAI routes while adapters are served, else the base model answers)",
            "# TYPE textgen_unknown_adapter_requests counter",
            f"textgen_unknown_adapter_requests {self.num_unknown_adapters}",
            "# HELP textgen_routed_adapter_requests requests sent to the worker group holding "
            "their LoRA adapter (the others take the priority lanes)",
            "# TYPE textgen_routed_adapter_requests counter",
            f"textgen_routed_adapter_requests {self.num_routed_adapter_requests}",
            "# HELP textgen_resumed_requests requests re-submitted with the tokens they had "
            "delivered, after Redis lost their token events (restart, failover, gap)",
            "# TYPE textgen_resumed_requests counter",
            f"textgen_resumed_requests {self.num_resumed_requests}",
            "# HELP textgen_replaced_attempt_events token events of a re-submitted request's "
            "earlier attempt that came after a gap, dropped (its new attempt makes the same "
            "tokens)",
            "# TYPE textgen_replaced_attempt_events counter",
            f"textgen_replaced_attempt_events {self.num_replaced_attempt_events}",
            "# HELP textgen_intake_unreplicated_requests requests accepted before enough "
            "replicas had them (WAIT timed out): a failover may lose them from Redis, and the "
            "gateway then re-submits them",
            "# TYPE textgen_intake_unreplicated_requests counter",
            f"textgen_intake_unreplicated_requests {self.num_unreplicated}",
            "# HELP textgen_redis_epoch_changes times this gateway found Redis restarted or "
            "failed over (a new run_id or replication id) when it subscribed again",
            "# TYPE textgen_redis_epoch_changes counter",
            f"textgen_redis_epoch_changes {self.num_redis_epoch_changes}",
            "# HELP textgen_redis_master_switches times the sentinels named a new Redis master "
            "while this gateway watched them (it then left the old primary at once), or times "
            "a Redis Cluster's slots got a new primary",
            "# TYPE textgen_redis_master_switches counter",
            f"textgen_redis_master_switches {self.num_redis_master_switches}",
        ]
        return ("\n".join(lines) + "\n").encode() + generate_latest(self.registry)

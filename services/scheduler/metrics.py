"""Prometheus metrics of a scheduler (served on --metrics-port)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from shared.telemetry import new_registry


class SchedulerMetrics:
    def __init__(self) -> None:
        self.registry = new_registry()
        r = self.registry
        self.running = Gauge("textgen_scheduler_running", "requests with KV blocks", registry=r)
        self.waiting = Gauge(
            "textgen_scheduler_waiting", "requests pulled, not admitted", registry=r
        )
        self.kv_blocks_used = Gauge(
            "textgen_scheduler_kv_blocks_used", "KV blocks in use", registry=r
        )
        self.kv_blocks = Gauge("textgen_scheduler_kv_blocks", "KV blocks of the group", registry=r)
        self.batch_size = Histogram(
            "textgen_scheduler_step_batch_size",
            "requests per step",
            buckets=[1, 2, 4, 8, 16, 32, 64, 128, 256, 512],
            registry=r,
        )
        self.step_round_trip = Histogram(
            "textgen_scheduler_step_round_trip_seconds",
            "plan sent to result received",
            buckets=[0.0005 * 1.6**i for i in range(24)],
            registry=r,
        )
        self.plan_wait = Histogram(
            "textgen_scheduler_plan_wait_seconds",
            "late planning: time the next plan waited for arrivals while the worker computed",
            buckets=[0.0005 * 1.6**i for i in range(20)],
            registry=r,
        )
        self.late_plan_arrivals = Counter(
            "textgen_scheduler_late_plan_arrivals",
            "requests that arrived during a late-planning wait (they start a step sooner)",
            registry=r,
        )
        self.plan_wait_wakes = Counter(
            "textgen_scheduler_plan_wait_wakes",
            "commands sent to end late-planning waits on time (Redis times a blocked read out "
            "late when nothing else wakes it)",
            registry=r,
        )
        self.stale_results = Counter(
            "textgen_scheduler_stale_step_results",
            "step results of an ended session (a plan the worker ran after the scheduler began "
            "anew), dropped",
            registry=r,
        )
        self.step_tokens = Histogram(
            "textgen_scheduler_step_tokens",
            "tokens scheduled per step",
            buckets=[1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192],
            registry=r,
        )
        self.pulled = Counter("textgen_scheduler_pulled_requests", "requests pulled", registry=r)
        self.admitted = Counter(
            "textgen_scheduler_admissions",
            "requests given KV blocks (re-admissions too)",
            registry=r,
        )
        self.ended = Counter(
            "textgen_scheduler_ended_requests", "requests ended, by status", ["status"], registry=r
        )
        self.preempted = Counter("textgen_scheduler_preemptions", "preemptions", registry=r)
        self.prefix_hit_rate = Gauge(
            "textgen_scheduler_prefix_cache_hit_rate",
            "share of admitted tokens found in the prefix cache",
            registry=r,
        )
        self.cached_blocks = Gauge(
            "textgen_scheduler_prefix_cache_blocks", "blocks holding a cached prefix", registry=r
        )
        self.orphaned = Counter(
            "textgen_scheduler_orphaned_routed_requests",
            "requests routed to a group that stopped beating or drains, taken by this one",
            registry=r,
        )
        self.claimed = Counter(
            "textgen_scheduler_claimed", "requests taken over from a silent scheduler", registry=r
        )
        self.handed_back = Counter(
            "textgen_scheduler_handed_back", "unfinished requests requeued at shutdown", registry=r
        )
        self.master_switches = Counter(
            "textgen_scheduler_redis_master_switches",
            "new Redis masters the sentinels named, or new primaries of a Redis Cluster's slots; "
            "each ended the session",
            registry=r,
        )

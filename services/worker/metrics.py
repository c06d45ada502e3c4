"""Prometheus metrics of a worker (served on --metrics-port)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from shared.messages import StepResult
from shared.telemetry import new_registry

STEP_BUCKETS = [0.0005 * 1.6**i for i in range(24)]
GAP_BUCKETS = [0.00005 * 2**i for i in range(16)]  # 50 µs to ~1.6 s


def step_histogram(name: str, documentation: str, registry: CollectorRegistry) -> Histogram:
    """A per-step duration in seconds (buckets from 0.5 ms to ~25 s)."""
    return Histogram(name, documentation, buckets=STEP_BUCKETS, registry=registry)


class WorkerMetrics:
    def __init__(self) -> None:
        self.registry = new_registry()
        r = self.registry
        self.step_duration = step_histogram(
            "textgen_worker_step_duration_seconds",
            "whole step on the worker: plan applied to tokens sampled",
            r,
        )
        self.forward_duration = step_histogram(
            "textgen_worker_forward_duration_seconds",
            "model forward per step",
            r,
        )
        self.sample_duration = step_histogram(
            "textgen_worker_sample_duration_seconds",
            "sampling per step",
            r,
        )
        self.tokens_per_s = Gauge(
            "textgen_worker_tokens_per_second",
            "tokens computed per second in the last step",
            registry=r,
        )
        self.batch_tokens = Histogram(
            "textgen_worker_step_tokens",
            "tokens computed per step",
            buckets=[1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192],
            registry=r,
        )
        self.generated_tokens = Counter(
            "textgen_worker_generated_tokens", "tokens sampled", registry=r
        )
        # speculation: acceptance rate = accepted / draft
        self.draft_tokens = Counter(
            "textgen_worker_speculative_draft_tokens", "n-gram proposals computed", registry=r
        )
        self.accepted_tokens = Counter(
            "textgen_worker_speculative_accepted_tokens", "proposals greedy confirmed", registry=r
        )
        self.skipped_plans = Counter(
            "textgen_worker_skipped_plans",
            "plans of an ended scheduler session not run: a new session's reset plan came "
            "behind them",
            registry=r,
        )
        self.step_failures = Counter(
            "textgen_worker_step_failures", "steps that raised", registry=r
        )
        self.publish_duration = step_histogram(
            "textgen_worker_publish_duration_seconds",
            "one step's token events and result written to Redis (on the torch thread, not "
            "waiting for the reply)",
            r,
        )
        self.overlapped_sends = Counter(
            "textgen_worker_overlapped_sends",
            "steps whose output went to Redis while the next step's pass ran on the device (a "
            "CUDA graph's replay, the simulated worker), off the steps' path; the others are "
            "sent between two steps",
            registry=r,
        )
        self.master_switches = Counter(
            "textgen_worker_redis_master_switches",
            "new Redis masters the sentinels named, or new primaries of a Redis Cluster's slots; "
            "the step link left the old primary",
            registry=r,
        )
        self.heartbeat_failures = Counter(
            "textgen_worker_heartbeat_failures",
            "heartbeats not written (logged; retried next beat): a scheduler drops the group "
            "when they fail for its heartbeat's lifetime",
            registry=r,
        )
        self.redis_error_replies = Counter(
            "textgen_worker_redis_error_replies",
            "writes Redis answered with an error (logged; the step went on)",
            registry=r,
        )
        self.step_gap = Histogram(
            "textgen_worker_step_gap_seconds",
            "torch thread between a step and the next one, when that plan had arrived before the "
            "step ended (back to back: sending the output and reading the plan)",
            buckets=GAP_BUCKETS,
            registry=r,
        )
        self.plan_late = Histogram(
            "textgen_worker_plan_late_seconds",
            "torch thread waiting for the next plan while it holds requests, the plan having "
            "come after the step before it ended (the broker's cost to the step rate)",
            buckets=GAP_BUCKETS,
            registry=r,
        )
        self.attention = Gauge(
            "textgen_worker_attention_info",
            "1 for the path forward passes take: cpu-kernels (the fast CPU decoder), "
            "flash-attn or sdpa (transformers' modules); instruction_set: what the CPU kernels "
            "were built for (amx: bfloat16 matmuls on AMX tiles too, avx512: bfloat16 and "
            "float32 matmuls on textgen's AVX512 kernels, avx2: float32 matmuls on textgen's "
            "AVX2 kernel, default or native; empty without them); bf16_matmul: what bfloat16 "
            "matmuls would run on (amx, avx512bf16: AVX512-BF16 dot products, avx512widen: "
            "FMAs of weights widened to float32, where faster or without AVX512-BF16, or "
            "onednn; empty without the CPU kernels); bf16_attention: what the kernel attends "
            "bfloat16 prompt chunks with (amx: chunks of 32 queries or more on AMX tiles, shorter "
            "ones as widen; dot: AVX512-BF16 dot products, where the matmuls keep theirs; "
            "widen: FMAs of widened keys and values; empty without the CPU kernels); "
            "projections: "
            "fused where q/k/v and gate/up are one matmul each (the fast CPU decoder, and "
            "transformers' Llama, Mistral and Qwen2 modules), else apart",
            ["kernel", "instruction_set", "bf16_matmul", "bf16_attention", "projections"],
            registry=r,
        )
        self.malloc_kept = Gauge(
            "textgen_worker_malloc_kept",
            "1 where glibc's malloc keeps the pages a CPU step's tensors free for the next step "
            "(mmaps only past 32 MiB, the heap never trimmed: services/worker/heap.py), else 0 "
            "(a GPU worker, or no glibc)",
            registry=r,
        )
        self.torch_threads = Gauge(
            "textgen_worker_torch_threads",
            "threads a forward pass computes on (torch's pool and textgen's CPU kernels): "
            "OMP_NUM_THREADS, which `textgen launch` sets to each worker process's share of the "
            "CPUs when several share them, else every CPU the worker may use",
            registry=r,
        )
        self.graph_steps = Counter(
            "textgen_worker_cuda_graph_steps",
            "decode steps replayed from a CUDA graph (the rest ran eagerly)",
            registry=r,
        )
        self.mixed_graph_steps = Counter(
            "textgen_worker_mixed_graph_steps",
            "steps with prompt chunks replayed from a CUDA graph of a token bucket",
            registry=r,
        )
        self.compiled_steps = Counter(
            "textgen_worker_compiled_steps",
            "steps of 2 tokens or more run by the model under torch.compile outside a CUDA graph",
            registry=r,
        )
        self.tiled_chunks = Counter(
            "textgen_worker_tiled_prompt_chunks",
            "prompt chunks of more than 16 queries attended as tiles by the Triton tile kernel",
            registry=r,
        )
        self.requests = Gauge("textgen_worker_requests", "requests held", registry=r)
        self.kv_blocks = Gauge("textgen_worker_kv_blocks", "KV-cache blocks allocated", registry=r)
        # constrained decoding (services/worker/grammar.py)
        self.grammar_compile_seconds = Histogram(
            "textgen_worker_grammar_compile_seconds",
            "a new constraint's grammar built for this tokenizer (off the step loop)",
            buckets=[0.0001 * 2**i for i in range(18)],
            registry=r,
        )
        self.grammar_compiles = Counter(
            "textgen_worker_grammar_compiles",
            "constraints attached to requests, by outcome: cache_hit, cache_miss (compiled), "
            "error (did not compile), timeout (outlasted --grammar-compile-timeout)",
            ["outcome"],
            registry=r,
        )
        self.grammar_mask_seconds = Histogram(
            "textgen_worker_grammar_mask_seconds",
            "one step's next-token bitmask filled for its constrained requests (beside the "
            "forward pass)",
            buckets=GAP_BUCKETS,
            registry=r,
        )
        self.grammar_waits = Counter(
            "textgen_worker_grammar_waits",
            "steps in which a request sampled nothing because its grammar was still compiling",
            registry=r,
        )
        # LoRA adapters (services/worker/lora.py)
        self.lora_loads = Counter(
            "textgen_worker_lora_loads",
            "LoRA adapters loaded into the group",
            ["adapter"],
            registry=r,
        )
        self.lora_load_seconds = Histogram(
            "textgen_worker_lora_load_seconds",
            "one adapter read from its folder and stacked (on the torch thread)",
            buckets=[0.001 * 2**i for i in range(14)],
            registry=r,
        )
        self.lora_evictions = Counter(
            "textgen_worker_lora_evictions",
            "LoRA adapters dropped (least recently used, or unregistered)",
            ["adapter"],
            registry=r,
        )
        self.lora_requests = Counter(
            "textgen_worker_lora_requests", "requests started per adapter", ["adapter"], registry=r
        )
        self.lora_tokens = Counter(
            "textgen_worker_lora_tokens", "tokens sampled per adapter", ["adapter"], registry=r
        )

    def observe_step(self, result: StepResult, num_requests: int) -> None:
        """A step's timings and counts; `num_requests`: the requests held after it."""
        self.step_duration.observe(result.step_s)
        self.forward_duration.observe(result.forward_s)
        self.sample_duration.observe(result.sample_s)
        if result.step_s > 0:
            self.tokens_per_s.set(result.num_tokens / result.step_s)
        self.batch_tokens.observe(result.num_tokens)
        self.generated_tokens.inc(sum(len(o.token_ids) for o in result.outputs))
        self.draft_tokens.inc(result.num_draft_tokens)
        self.accepted_tokens.inc(result.num_accepted_tokens)
        self.grammar_waits.inc(sum(o.awaits_grammar for o in result.outputs))
        self.requests.set(num_requests)

    def lora_loaded(self, adapter: str, seconds: float) -> None:
        self.lora_loads.labels(adapter).inc()
        self.lora_load_seconds.observe(seconds)

    def lora_evicted(self, adapter: str) -> None:
        self.lora_evictions.labels(adapter).inc()

"""Building a worker's runtime from a loaded model: the one factory the worker service, the
tensor-parallel ranks and the in-process engine all use.

    LoadedModel -> ForwardBackend (pick_backend) -> KV block size (the backend's)
                -> number of blocks (given, or from the memory budget) -> PagedKVCache
                -> ModelRunner -> WorkerReady (what the scheduler plans with)

The scheduler side has its counterpart: `SchedulerConfig.for_worker(ready, ...)` turns the
WorkerReady into the admission policy, for the scheduler service and the engine alike.
"""

from __future__ import annotations

import logging
import time

from services.worker import flash_attention, heap, step_budget
from services.worker.backends import (
    FastDecoderPass,
    ForwardBackend,
    PagedSdpa,
    TransformersPaged,
)
from services.worker.cuda_graphs import CudaPaged
from services.worker.cuda_graphs import default_sizes as default_graph_sizes
from services.worker.fake import Simulated
from services.worker.fallback import EncoderDecoder, OwnCache
from services.worker.grammar import GrammarEngine
from services.worker.kv_cache import PagedKVCache, default_budget, plan_num_blocks
from services.worker.loader import FALLBACK, SEQ2SEQ, LoadedModel
from services.worker.lora import LoraSet, hook_modules, linear_modules, module_ops
from services.worker.metrics import WorkerMetrics
from services.worker.runner import ModelRunner
from shared.messages import WorkerReady
from shared.model_files import vocab_size_of

log = logging.getLogger(__name__)


def pick_backend(
    loaded: LoadedModel,
    fake_step_ms: float | None = None,
    cuda_graphs: list[int] | None = None,
    compile: bool = True,
) -> ForwardBackend:
    """What runs the forward pass of `loaded` (services/worker/backends.py has the table).
    cuda_graphs: the decode batch sizes to capture on CUDA (None: default_sizes; quantized and
    tensor-parallel models run eagerly); `compile`: the graphs and eager steps run the model
    under torch.compile."""
    if fake_step_ms is not None:
        return Simulated(fake_step_ms, vocab_size_of(loaded.folder), loaded.eos_token_ids)
    if loaded.runner == FALLBACK:
        return OwnCache(loaded.model, loaded.device)
    if loaded.runner == SEQ2SEQ:
        return EncoderDecoder(loaded.model, loaded.device)
    if loaded.decoder is not None:
        return FastDecoderPass(loaded.decoder)
    flash = flash_attention.is_available(loaded.device, loaded.cache_shape)
    if loaded.device.type == "cuda" or flash:
        eager = loaded.quantize is not None or loaded.world_size > 1
        sizes = [] if eager else cuda_graphs or []
        return CudaPaged(loaded.model, loaded.device, sizes, flash, compile)
    return PagedSdpa(loaded.model, loaded.device)


def build_runner(
    loaded: LoadedModel,
    *,
    block_size: int = 16,
    num_blocks: int | None = None,
    kv_cache_memory: int | None = None,
    max_batch_size: int = 256,
    max_batch_total_tokens: int | None = None,
    speculate: int = 0,
    fake_step_ms: float | None = None,
    grammar_compile_timeout: float | None = 10.0,
    metrics: WorkerMetrics | None = None,
    max_loras: int = 0,
    cuda_graphs: list[int] | None = None,
    compile: bool = True,
) -> ModelRunner:
    """The runner of `loaded` with its KV cache: `num_blocks` blocks when given (a
    tensor-parallel rank takes rank 0's), else as many as `kv_cache_memory` bytes (default: a
    share of free memory) hold, never more than a full batch of full contexts would use.
    `grammar_compile_timeout` None: no constrained decoding (a request with a constraint fails
    with the reason), as on the ranks of a tensor-parallel group. `max_loras`: LoRA adapters
    held at once (0: none; a request naming one fails with the reason). `cuda_graphs`: decode
    batch sizes captured on CUDA (None: 1, 2, 4, 8, then every 16 up to max_batch_size); with
    `compile`, the graphs and eager steps run the model under torch.compile."""
    if cuda_graphs is None:
        cuda_graphs = default_graph_sizes(max_batch_size)
    backend = pick_backend(
        loaded, fake_step_ms, [size for size in cuda_graphs if size <= max_batch_size], compile
    )
    block_size = backend.block_size(block_size, loaded.device, loaded.cache_shape)
    if num_blocks is None:
        budget = kv_cache_memory or default_budget(loaded.device)
        max_tokens = max_batch_total_tokens or max_batch_size * loaded.max_model_len
        num_blocks = plan_num_blocks(loaded.cache_shape, block_size, budget, max_tokens)
    cache = PagedKVCache(
        loaded.cache_shape,
        num_blocks,
        block_size,
        loaded.device,
        allocate=backend.uses_paged_cache,
        spare_blocks=backend.spare_blocks,
    )
    backend.capture(cache, loaded.max_model_len)
    # after the cache and weights: they keep their own pages
    kept = loaded.device.type == "cpu" and heap.keep_freed_memory()
    if metrics is not None:
        metrics.malloc_kept.set(int(kept))
    log.info(
        "forward passes on %s; KV cache of %d blocks x %d tokens",
        backend.name,
        num_blocks,
        block_size,
    )
    lora = lora_set(backend, loaded, max_loras, metrics) if max_loras else None
    return ModelRunner(
        backend,
        cache,
        loaded.eos_token_ids,
        loaded.max_model_len,
        loaded.device,
        num_speculative_tokens=speculate,
        kernels=loaded.kernels,
        grammar=None
        if grammar_compile_timeout is None
        else GrammarEngine(
            loaded.folder,
            vocab_size_of(loaded.folder),
            loaded.eos_token_ids,
            grammar_compile_timeout,
            metrics,
        ),
        lora=lora,
    )


def lora_set(
    backend: ForwardBackend, loaded: LoadedModel, max_loras: int, metrics: WorkerMetrics | None
) -> LoraSet | None:
    """Where `backend` can apply LoRA adapters: the set it applies (empty until a request
    names one). None for the per-request fallback runners and simulated workers."""
    dtype = loaded.cache_shape.dtype
    if isinstance(backend, FastDecoderPass):
        decoder = backend.decoder
        ops = decoder.lora_ops
        modules = {name: (op.in_features, out) for op in ops.values() for name, out in op.parts}
        lora = LoraSet(max_loras, dtype, modules, ops)
        decoder.lora = lora
    elif isinstance(backend, TransformersPaged):
        model = backend.model
        lora = LoraSet(max_loras, dtype, linear_modules(model), module_ops(model))
        lora.install = lambda: hook_modules(model, lora)
    else:
        return None
    if loaded.kernels is not None and loaded.kernels.supports(dtype):
        lora.kernels = loaded.kernels  # each row's own product on the CPU (lora.inc)
    if metrics is not None:
        lora.on_load = metrics.lora_loaded
        lora.on_evict = metrics.lora_evicted
        lora.on_request = lambda name: metrics.lora_requests.labels(name).inc()
        lora.on_tokens = lambda name, count: metrics.lora_tokens.labels(name).inc(count)
    return lora


def ready_message(
    runner: ModelRunner,
    loaded: LoadedModel,
    *,
    group: str,
    model_id: str,
    max_batch_size: int,
    world_size: int = 1,
    started_at: float | None = None,
) -> WorkerReady:
    """What a worker group announces: its capacity and how it runs the model."""
    cache = runner.kv_cache
    return WorkerReady(
        group=group,
        model_id=model_id,
        num_blocks=cache.num_blocks,
        block_size=cache.block_size,
        max_batch_size=max_batch_size,
        max_model_len=loaded.max_model_len,
        eos_token_ids=loaded.eos_token_ids,
        dtype=str(loaded.cache_shape.dtype).removeprefix("torch."),
        device=str(loaded.device),
        world_size=world_size,
        num_speculative_tokens=runner.num_speculative_tokens,
        runner=loaded.runner,
        attention=runner.attention,
        started_at=time.time() if started_at is None else started_at,
        step_tokens=step_budget.suggest(loaded.model, loaded.device, loaded.cache_shape.dtype),
        max_loras=runner.lora.capacity if runner.lora is not None else 0,
    )

"""How a step's forward pass runs: the one interface between the runner and its attention paths.

The runner packs a step the same way whatever runs it (`PackedBatch`: every scheduled token as
one sequence, each request's place in it, its block table and cache slots, and the rows whose
logits it needs). A `ForwardBackend` turns that into logits: `prepare` builds what its
attention reads, once per step for every layer; `forward` computes the wanted rows' logits.
One is picked when the model loads (services/worker/runtime.py) and `name` is what /info's
`model_attention` and the worker's metrics call it.

    backend           name          runs                                        paged cache
    PagedSdpa         sdpa          transformers' modules, SDPA over the blocks      yes
    CudaPaged         triton        transformers' modules on CUDA: a Triton kernel   yes
                                    (flash-attn if installed), decode CUDA graphs
    FastDecoderPass   cpu-kernels   textgen's fast decoder on the CPU kernels        yes
    OwnCache          sdpa          each request on the model's own cache (ALiBi)    no
    EncoderDecoder    sdpa          T5-style models, encoder once, then decoder      no
    Simulated         sdpa          no model: sleeps (--fake-step-ms)                no

CudaPaged lives in services/worker/cuda_graphs.py, the last three in
services/worker/fallback.py and services/worker/fake.py.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch

from services.worker import flash_attention
from services.worker.fast_decoder import FAST_DECODER, FastDecoder, StepTables
from services.worker.int8_rows import isolate_int8_rows
from services.worker.kv_cache import PagedKVCache
from services.worker.paged_attention import METADATA_KWARG, AttentionMetadata, make_decode_group
from services.worker.state import RequestState


@dataclass
class PackedBatch:
    """One step, packed as one sequence (services/worker/paged_attention.py draws it)."""

    input_ids: torch.Tensor  # [1, num_tokens]
    position_ids: torch.Tensor  # [1, num_tokens]
    query_start: list[int]  # [num_requests + 1] offsets of each request's tokens
    context_lens: list[int]  # [num_requests] cached tokens per request after this step
    block_tables: list[list[int]]  # per request: its block ids (may reserve blocks ahead)
    slot_mapping: torch.Tensor  # [num_tokens] cache slot of each packed token
    sample_rows: list[int]  # [num_sampling] packed index of each sampling request's last token
    sampling: list[RequestState]  # requests that sample this step, in row order
    prompt_rows: list[int]  # packed rows whose logits score the next prompt token
    prompt_targets: list[int]  # the prompt token each of prompt_rows scores
    prompt_owners: list[RequestState]  # the request of each of prompt_rows
    draft_rows: list[int]  # packed rows of speculative proposals (their logits verify)
    draft_owners: list[RequestState]  # the request of each of draft_rows
    states: list[RequestState]  # the scheduled requests, in packed order
    prepared: Any = field(default=None)  # what the backend built for this step (prepare)

    @property
    def kept_rows(self) -> list[int]:
        """The rows whose logits the step needs: sampling, then drafts, then prompt rows."""
        return self.sample_rows + self.draft_rows + self.prompt_rows


class ForwardBackend(ABC):
    """Turns a PackedBatch into logits. Owned by one runner, called on the torch thread only:
    `release`, then `prepare`, then `forward`, once per step."""

    name: str = flash_attention.SDPA  # what /info and the metrics call it
    can_speculate: bool = True  # drafts are verified in the same pass
    uses_paged_cache: bool = True  # False: KV blocks are only accounted, never allocated
    spare_blocks: int = 0  # KV blocks allocated past the scheduler's, for the backend's use
    graph_steps: int = 0  # decode steps replayed from a CUDA graph so far (CudaPaged)
    mixed_graph_steps: int = 0  # steps with prompt chunks replayed from one so far (CudaPaged)
    compiled_steps: int = 0  # steps run by the compiled model outside a graph so far (CudaPaged)
    tiled_chunks: int = 0  # prompt chunks attended as tiles by the Triton kernel so far (CudaPaged)
    # the pass can be queued on its device and run on while the host works (a CUDA graph's
    # replay; the simulated worker): the worker then sends the step before's output meanwhile
    launches_async: bool = False
    on_queued: Callable[[], None] | None = None  # the worker's, for one forward: see queued()

    def queued(self) -> None:
        """Called by a backend that launches asynchronously once the pass is queued (before
        it has run): the worker's `on_queued` runs then, once."""
        callback, self.on_queued = self.on_queued, None
        if callback is not None:
            callback()

    def block_size(self, requested: int, device: torch.device, shape: Any) -> int:
        """The KV block size the backend can read, given the one asked for."""
        return requested

    def capture(self, kv_cache: PagedKVCache, max_model_len: int) -> None:  # noqa: B027
        """Get ready to run over `kv_cache` once it is allocated (CUDA graphs are captured)."""

    def release(self, live_request_ids: Iterable[str]) -> None:  # noqa: B027 (most keep none)
        """Forget per-request state of every request not in `live_request_ids`."""

    def prepare(self, batch: PackedBatch, kv_cache: PagedKVCache) -> Any:
        """What the step's attention reads, built once for every layer."""
        return None

    @abstractmethod
    def forward(self, batch: PackedBatch, kv_cache: PagedKVCache, rows: list[int]) -> torch.Tensor:
        """The logits of the packed `rows`, in that order. [len(rows), vocab]"""


class TransformersPaged(ForwardBackend):
    """transformers' own modules, attention through textgen's paged attention function
    (services/worker/paged_attention.py), the step's AttentionMetadata passed alongside."""

    def __init__(self, model: torch.nn.Module, device: torch.device) -> None:
        self.model = model
        self.device = device
        self.int8_rows = isolate_int8_rows(model)  # None unless LLM.int8() layers

    def metadata(self, batch: PackedBatch, kv_cache: PagedKVCache) -> AttentionMetadata:
        return AttentionMetadata(
            kv_cache=kv_cache,
            slot_mapping=batch.slot_mapping,
            query_start=batch.query_start,
            context_lens=batch.context_lens,
            context_slots=[],
        )

    def prepare(self, batch: PackedBatch, kv_cache: PagedKVCache) -> AttentionMetadata:
        return self.metadata(batch, kv_cache)

    @torch.inference_mode()
    def forward(self, batch: PackedBatch, kv_cache: PagedKVCache, rows: list[int]) -> torch.Tensor:
        keep_rows = torch.tensor(rows, dtype=torch.long, device=self.device)
        with self.int8_rows.active(batch.query_start) if self.int8_rows else nullcontext():
            output = self.model(
                input_ids=batch.input_ids,
                position_ids=batch.position_ids,
                use_cache=False,
                logits_to_keep=keep_rows,
                **{METADATA_KWARG: batch.prepared},
            )
        return output.logits[0]


class PagedSdpa(TransformersPaged):
    """Decodes attended together over their padded block tables, prompt chunks one by one,
    with torch's scaled_dot_product_attention."""

    name = flash_attention.SDPA

    def metadata(self, batch: PackedBatch, kv_cache: PagedKVCache) -> AttentionMetadata:
        meta = super().metadata(batch, kv_cache)
        meta.context_slots = [  # [context_len] each
            kv_cache.slots(blocks, length).to(self.device)
            for blocks, length in zip(batch.block_tables, batch.context_lens, strict=True)
        ]
        query_start = batch.query_start
        decodes = [i for i in range(len(batch.states)) if query_start[i + 1] - query_start[i] == 1]
        if len(decodes) > 1:
            meta.decodes = make_decode_group(
                [query_start[i] for i in decodes],
                [batch.block_tables[i] for i in decodes],
                [batch.context_lens[i] for i in decodes],
                kv_cache.block_size,
                self.device,
            )
            is_decode = set(decodes)
            meta.prefill_indices = [i for i in range(len(batch.states)) if i not in is_decode]
        return meta


class FastDecoderPass(ForwardBackend):
    """textgen's fast decoder (services/worker/fast_decoder.py) on the CPU kernels."""

    name = FAST_DECODER

    def __init__(self, decoder: FastDecoder) -> None:
        self.decoder = decoder

    def prepare(self, batch: PackedBatch, kv_cache: PagedKVCache) -> StepTables:
        return StepTables.build(
            batch.query_start,
            batch.context_lens,
            batch.block_tables,
            kv_cache.block_size,
            batch.slot_mapping,
            self.decoder.dense_min_keys,
            self.decoder.dense_min_queries,
        )

    def forward(self, batch: PackedBatch, kv_cache: PagedKVCache, rows: list[int]) -> torch.Tensor:
        keep_rows = torch.tensor(rows, dtype=torch.long)
        return self.decoder(
            batch.input_ids[0], batch.position_ids[0], batch.prepared, kv_cache, keep_rows
        )

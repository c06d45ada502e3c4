"""The CUDA forward pass: paged attention through a Triton kernel, decode steps as CUDA graphs,
the model under torch.compile.

Eager steps (prompt chunks, mixed steps, LoRA, speculative drafts): transformers' modules with
textgen's paged attention function, compiled (`CudaPaged.compiled`) for steps of 2 tokens or
more unless LoRA hooks are on the modules. Requests of at most ROW_QUERIES queries (decodes,
drafts) are query rows of one Triton kernel, longer prompt chunks tiles of TILE_QUERIES queries
(services/worker/paged_attention.py) of another; both read the requests' blocks in place
(services/worker/triton_attention.py, triton_tiles.py), so a layer's attention is two launches
whatever the step holds. With flash-attn installed, every request goes through
flash_attn_varlen_func instead.

Decode steps (every request one query, nothing else asked of the pass) replay a CUDA graph: at
load, the whole forward pass is captured once per batch size in `sizes` (TGI's --cuda-graphs),
over static input buffers, largest first into one shared memory pool. A step of B requests
replays the smallest graph of at least B rows; the padding rows read and write one spare KV
block that the scheduler never hands out, so they touch no request's cache:

    static rows   | r0 | r1 | r2 | pad | pad |        graph of 5 rows, a step of 3
    slot_mapping  | s  | s  | s  | spare block's first slot ...
    row_lens      | n0 | n1 | n2 |  1  |  1  |
    logits        | l0 | l1 | l2 |  -  |  -  |  -> the step's 3 rows

Python and launch overhead then cost one replay per step instead of ~10 kernel launches per
layer, which is what decides the step time of small models on a GPU; the graphs are captured
from the compiled model, whose fused kernels make fewer launches still. Steps with prompt
chunks replay graphs of token buckets the same way (services/worker/mixed_graphs.py).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from services.worker import flash_attention
from services.worker.backends import PackedBatch, TransformersPaged
from services.worker.kv_cache import PagedKVCache
from services.worker.lora import HOOKED
from services.worker.mixed_graphs import MixedGraphs
from services.worker.paged_attention import GRAPH_STEP, IN_GRAPH, METADATA_KWARG, AttentionMetadata
from services.worker.row_tables import RowTables, row_tables, split_queries

log = logging.getLogger(__name__)

TRITON = "triton"  # the attention name the worker reports (/info model_attention)


def default_sizes(max_batch_size: int) -> list[int]:
    """Batch sizes captured when --cuda-graphs is not given: 1, 2, 4, 8, then every 16 up
    to --max-batch-size (vLLM's spacing)."""
    sizes = [size for size in (1, 2, 4, 8) if size <= max_batch_size]
    sizes += list(range(16, max_batch_size + 1, 16))
    if sizes[-1] != max_batch_size:
        sizes.append(max_batch_size)
    return sizes


@dataclass
class GraphStep:
    """A decode step copied into the static buffers: replay `graph`, keep `num_rows` rows."""

    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor  # [graph rows, vocab], written by the replay
    num_rows: int
    mixed: bool = False  # a mixed step's graph (services/worker/mixed_graphs.py)


class CudaPaged(TransformersPaged):
    """transformers' modules on CUDA: Triton paged attention, SDPA (or flash-attn) for long
    prompt chunks, CUDA graphs for decode steps, torch.compile for both graphs and eager
    steps."""

    name = TRITON
    spare_blocks = 1  # the padding rows' block (graph replays)
    launches_async = True  # CUDA queues the pass; sampling waits for it
    compiler: Any = "inductor"  # torch.compile's backend (the graphs and eager steps)

    def __init__(
        self,
        model: torch.nn.Module,
        device: torch.device,
        sizes: list[int],
        flash: bool = False,
        compile: bool = False,
    ) -> None:
        super().__init__(model, device)
        self.sizes = sorted(set(sizes))  # batch sizes with a graph (empty: always eager)
        # the graphs and eager steps run the model under torch.compile (`compiled`); False
        # without graphs (quantized and tensor-parallel groups) or once compiling failed
        self.compile = compile and bool(self.sizes)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.static: dict[str, torch.Tensor] = {}  # the attention's tables, for every size
        # per graph size: its input ids, positions and kept rows (`_inputs`)
        self.inputs: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.spare_slot = 0  # the first slot of the spare block (set with the buffers)
        self.flash = flash  # flash-attn is installed: it attends the eager steps
        self.graph_steps = 0  # decode steps replayed from a graph
        self.mixed_graph_steps = 0  # steps with prompt chunks replayed from a graph
        self.mixed: MixedGraphs | None = None  # their graphs (with the decode graphs' buffers)
        self.pool: Any = None  # the graphs' shared memory pool
        self.compiled_steps = 0  # steps of 2 tokens or more run by the compiled model
        self.tiled_chunks = 0  # prompt chunks attended as tiles
        self.tiles: bool | None = None  # the tile kernel runs here (None: not checked yet)
        self.row_splits: int | None = None  # key ranges per decode row (None: as rows ask)
        self.name = flash_attention.FLASH_ATTN if flash else TRITON

    def block_size(self, requested: int, device: torch.device, shape: Any) -> int:
        if not self.flash:
            return requested
        return flash_attention.flash_block_size(requested, device, shape)

    def metadata(self, batch: PackedBatch, kv_cache: PagedKVCache) -> AttentionMetadata:
        meta = super().metadata(batch, kv_cache)
        block_size = kv_cache.block_size
        if self.flash:
            meta.flash = flash_attention.make_metadata(
                batch.query_start, batch.context_lens, batch.block_tables, block_size, self.device
            )
            return meta
        short, long = split_queries(batch)
        tiled = long if long and self.tiles_agree(kv_cache) else []
        if short or tiled:
            meta.rows = row_tables(batch, short, tiled, block_size, self.device)
            meta.rows.splits = self.row_splits
        self.tiled_chunks += len(tiled)
        # without the tile kernel, the longer chunks go to SDPA one by one
        meta.prefill_indices = [] if tiled else long
        if meta.prefill_indices:
            longer = set(long)
            meta.context_slots = [
                kv_cache.slots(batch.block_tables[i], batch.context_lens[i]).to(self.device)
                if i in longer
                else torch.empty(0, dtype=torch.long)
                for i in range(len(batch.context_lens))
            ]
        return meta

    def tiles_agree(self, kv_cache: PagedKVCache) -> bool:
        """Whether the tile kernel runs here (checked once: at start on CUDA, else at the first
        longer chunk)."""
        if self.tiles is None:
            from services.worker import kernel_checks  # Triton: only where this runs

            self.tiles = kernel_checks.tiles_agree(*kernel_checks.shape(self.model, kv_cache))
        return self.tiles

    def prepare(self, batch: PackedBatch, kv_cache: PagedKVCache) -> Any:  # or a GraphStep
        num_rows = len(batch.states)
        size = next((size for size in self.sizes if size >= num_rows), None)
        if (
            size is None
            or size not in self.graphs
            or batch.input_ids.shape[1] != num_rows  # a prompt chunk or drafts
            or len(batch.sample_rows) != num_rows  # a 1-token chunk that samples nothing
            or batch.prompt_rows
            or any(state.adapter is not None for state in batch.states)
        ):
            return self.mixed_step(batch, kv_cache)
        self._fill(batch, num_rows, size, kv_cache.block_size)
        graph, logits = self.graphs[size]
        return GraphStep(graph, logits, num_rows)

    def mixed_step(self, batch: PackedBatch, kv_cache: PagedKVCache) -> Any:  # or a GraphStep
        """A step that is no plain decode: copied into a mixed graph's buffers where one holds
        it (services/worker/mixed_graphs.py), else the metadata of an eager step."""
        kept = batch.kept_rows or [batch.input_ids.shape[1] - 1]  # the rows forward gets
        adapters = any(state.adapter is not None for state in batch.states)
        mixed = self.mixed
        graph = None if mixed is None or adapters else mixed.pick(batch, kept)
        if mixed is None or graph is None or graph.logits is None:
            return self.metadata(batch, kv_cache)
        self.tiled_chunks += mixed.fill(graph, batch, kept, kv_cache.block_size)
        return GraphStep(graph.graph, graph.logits, len(kept), mixed=True)

    def forward(self, batch: PackedBatch, kv_cache: PagedKVCache, rows: list[int]) -> torch.Tensor:
        step = batch.prepared
        if isinstance(step, GraphStep):  # its rows are `rows` (a decode graph's: one each)
            step.graph.replay()
            self.queued()  # the GPU runs the graph while the step before's output goes out
            if step.mixed:
                self.mixed_graph_steps += 1
            else:
                self.graph_steps += 1
            return step.logits[: step.num_rows]
        self.queued()  # before an eager pass's launches, which keep the host busy
        # LoRA hooks on the modules: they run as they are
        if self.compile and batch.input_ids.shape[1] > 1 and not hasattr(self.model, HOOKED):
            inputs = self._eager_inputs(batch.input_ids, batch.position_ids, rows)
            with torch.inference_mode():
                logits = self.run_model(*inputs, step)
            self.compiled_steps += 1
            return logits[: len(rows)]
        return super().forward(batch, kv_cache, rows)

    def _eager_inputs(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, rows: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """An eager step's input ids, positions and kept rows in the one shape the compiled
        model serves them all in: 2 kept rows or more (padded), plain tensors (not inference
        tensors), as the graphs' buffers are."""
        kept = rows if len(rows) > 1 else (rows * 2 or [0, 0])
        with torch.inference_mode(False):
            keep = torch.tensor(kept, dtype=torch.long).to(self.device, non_blocking=True)
            return input_ids.clone(), position_ids.clone(), keep

    def run_model(
        self,
        input_ids: torch.Tensor,  # [1, num_tokens]
        position_ids: torch.Tensor,  # [1, num_tokens]
        keep: torch.Tensor,  # [num_kept] long: the packed rows whose logits are kept
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """The model (under torch.compile where `compile`), its attention one operator per
        layer over `meta`. [num_kept, vocab] logits"""
        model = self.compiled if self.compile else self.model
        GRAPH_STEP[0] = meta  # what the layers' attention operator reads
        try:
            return model(
                input_ids=input_ids,
                position_ids=position_ids,
                use_cache=False,
                logits_to_keep=keep,
                **{METADATA_KWARG: IN_GRAPH},
            ).logits[0]
        finally:
            GRAPH_STEP[0] = None

    def _fill(self, batch: PackedBatch, num_rows: int, size: int, block_size: int) -> None:
        """Copy the step into the static buffers; padding rows up to `size` use the spare block."""
        static = self.static
        lens = batch.context_lens + [1] * (size - num_rows)
        table, max_blocks = PagedKVCache.padded_block_tables(
            batch.block_tables, batch.context_lens, block_size
        )
        staged = torch.tensor(lens + table, dtype=torch.int32).to(self.device)
        static["row_lens"][:size].copy_(staged[:size])
        static["block_tables"][:num_rows, :max_blocks].copy_(staged[size:].view(num_rows, -1))
        static["block_tables"][num_rows:size].fill_(self.spare_slot // block_size)
        input_ids, position_ids, _ = self.inputs[size]
        input_ids[0, :num_rows].copy_(batch.input_ids[0])
        position_ids[0, :num_rows].copy_(batch.position_ids[0])
        static["slot_mapping"][:num_rows].copy_(batch.slot_mapping)
        static["slot_mapping"][num_rows:size].fill_(self.spare_slot)

    def allocate_static(self, kv_cache: PagedKVCache, max_model_len: int) -> None:
        """The graphs' input buffers, sized for the largest graph, padding rows on the spare
        block (plain tensors, not inference tensors: each step copies into them)."""
        largest = max(self.sizes[-1], 3)  # 3: the eager step compile_step compiles
        block_size = kv_cache.block_size
        spare_block = kv_cache.num_blocks  # allocated past the scheduler's blocks
        max_blocks = -(-max_model_len // block_size)
        device = self.device

        def int_buffer(*shape: int, fill: int, dtype=torch.int32) -> torch.Tensor:
            return torch.full(shape, fill, dtype=dtype, device=device)

        self.static = {
            "slot_mapping": int_buffer(largest, fill=spare_block * block_size, dtype=torch.long),
            "rows": torch.arange(largest, dtype=torch.int32, device=device),
            "row_lens": int_buffer(largest, fill=1),
            "block_tables": int_buffer(largest, max_blocks, fill=spare_block),
        }
        self.spare_slot = spare_block * block_size
        self.inputs = {size: self._inputs(size) for size in self.sizes}
        if self.tiles and not self.flash:  # mixed steps attend through both kernels
            self.mixed = MixedGraphs(
                kv_cache, self.static["block_tables"], self.spare_slot, largest, self.row_splits
            )

    def _inputs(self, size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A graph's own input ids, positions and kept rows ([1, size], [1, size], [size]):
        plain tensors that are no views, like an eager step's, so that torch.compile traces
        both alike (a view of a larger buffer is traced apart)."""
        with torch.inference_mode(False):
            ids = torch.zeros(1, size, dtype=torch.long, device=self.device)
            return ids, ids.clone(), torch.arange(size, device=self.device)

    def capture(self, kv_cache: PagedKVCache, max_model_len: int) -> None:
        """One graph per size, largest first, sharing one memory pool (and first, on CUDA, the
        checks of the split decode rows that the graphs and eager steps would hold and of the
        tile kernel, which build the kernels before the first request waits on a build)."""
        if self.device.type == "cuda":
            from services.worker import kernel_checks  # Triton: only where this runs

            if not kernel_checks.splits_agree(*kernel_checks.shape(self.model, kv_cache)):
                self.row_splits = 1
            if not self.flash:
                self.tiles_agree(kv_cache)
        if not self.sizes or self.device.type != "cuda":
            return
        self.allocate_static(kv_cache, max_model_len)
        with torch.inference_mode():
            if self.compile:
                self.compile_step(kv_cache)
            started = time.perf_counter()
            self._capture_all(kv_cache)
        log.info(
            "CUDA graphs for decode batch sizes %s%s captured in %.1f s (%s)",
            ",".join(map(str, self.sizes)),
            f" and steps with prompt chunks of up to {max(self.mixed.graphs) - 1} tokens"
            if self.mixed
            else "",
            time.perf_counter() - started,
            "torch.compile's kernels" if self.compile else "eager modules",
        )

    @functools.cached_property
    def compiled(self) -> Callable[..., Any]:
        """The model under torch.compile (inductor): the norms, rotary embeddings and
        activations of a layer fuse into a few kernels around its matmuls and its attention
        operator, and the Python of transformers' modules is gone from eager steps. Sizes are
        symbolic: one compilation serves every step of 2 tokens or more, another steps of 1."""
        return torch.compile(self.model, backend=self.compiler, dynamic=True)

    def compile_step(self, kv_cache: PagedKVCache) -> None:
        """Compile the forward pass, its padding rows writing the spare block: first as an
        eager step of 3 tokens keeping 2 rows (sizes apart: the shape every step of 2 tokens
        or more shares, graphs included; compiled on equal sizes first, duck sizing would tie
        them), then the smallest graph's (1 token); where torch.compile fails, the reason is
        logged and `compile` turns False (graphs and eager steps then run transformers'
        modules as they are)."""
        started = time.perf_counter()
        try:
            ids = torch.zeros(1, 3, dtype=torch.long, device=self.device)
            inputs = self._eager_inputs(ids, ids, [0, 2])
            self.run_model(*inputs, self._static_meta(kv_cache, 3))
            for size in {self.sizes[-1], self.sizes[0]}:
                self.step_function(kv_cache, size)()
        except Exception as exc:  # noqa: BLE001  # any failure of the compiler: run eagerly
            log.warning("torch.compile failed, decode graphs hold the eager modules: %r", exc)
            torch._dynamo.reset()
            self.compile = False
            return
        log.info("decode step compiled in %.1f s", time.perf_counter() - started)

    def step_function(self, kv_cache: PagedKVCache, size: int) -> Callable[[], torch.Tensor]:
        """The forward pass of a decode step of `size` rows over the static buffers: what a
        graph captures. [size, vocab] logits"""
        meta = self._static_meta(kv_cache, size)
        inputs = self.inputs.get(size) or self._inputs(size)
        return lambda: self.run_model(*inputs, meta)

    def _static_meta(self, kv_cache: PagedKVCache, size: int) -> AttentionMetadata:
        """A decode step of `size` rows over the static buffers, as the attention reads it."""
        static = self.static
        return AttentionMetadata(
            kv_cache=kv_cache,
            slot_mapping=static["slot_mapping"][:size],
            query_start=[],
            context_lens=[],
            context_slots=[],
            prefill_indices=[],
            rows=RowTables(
                rows=static["rows"][:size],
                row_request=static["rows"][:size],
                row_lens=static["row_lens"][:size],
                block_tables=static["block_tables"][:size],
                splits=self.row_splits,
            ),
        )

    def _capture_all(self, kv_cache: PagedKVCache) -> None:
        for size in reversed(self.sizes):
            self.graphs[size] = self.record(self.step_function(kv_cache, size))
        if self.mixed is not None:
            try:
                self.mixed.capture(self.run_model, self.record)
            except Exception as exc:  # noqa: BLE001  # such steps then run eagerly, as before
                log.warning("no CUDA graphs for steps with prompt chunks: %r", exc)
                self.mixed = None
        torch.cuda.synchronize(self.device)

    def record(self, run: Callable[[], torch.Tensor]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """`run` captured as a CUDA graph into the shared pool (after two runs on a side
        stream: they build its kernels and settle the allocator): the graph, its output."""
        device = self.device
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(2):
                run()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = run()
        self.pool = graph.pool()
        return graph, logits

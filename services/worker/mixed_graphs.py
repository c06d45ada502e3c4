"""CUDA graphs for steps with prompt chunks (mixed steps): a step of T tokens, decodes and
chunks together, replays the graph of the smallest bucket (BUCKETS) of more than T tokens.

An eager step costs its launches: on an H200 a step of one 16-token chunk took 11 ms and one
of 158 tokens 13.5 ms (launches and Python), against 2.4 ms for a batch-32 decode replay, and
a served run's streams drift apart, so new prompts come a few at a time and each costs the
whole batch an eager step. A bucket's graph holds the whole forward pass over its own static
buffers, its attention both Triton kernels over tables of fixed length: the step's rows and
tiles first, then padding the kernels skip (a row that sees no keys writes zeros, a tile of no
queries writes nothing):

    tokens       | t0 .. t(T-1) | pad .. pad |           bucket of B > T tokens
    slot_mapping | the step's   | spare block's first slot (the scheduler never hands it out)
    rows         | the step's n | pad rows: tokens T..B-1 each, then B-1 again, keys 0
    tiles        | the step's t | pad tiles: 0 queries
    keep         | its k rows   | (stale rows, all < B)  -> logits of the step's k rows

The padding tokens' keys go to the spare block and their attention output is zero, so no
request's cache or logits see them. Steps a graph cannot hold run eagerly as before: prompt
logprobs, LoRA adapters, as many tokens as the largest bucket or more, more kept rows than a
bucket keeps, flash-attn, or no tile kernel.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from services.worker.backends import PackedBatch
from services.worker.kv_cache import PagedKVCache
from services.worker.paged_attention import AttentionMetadata
from services.worker.row_tables import (
    ROW_QUERIES,
    TILE_QUERIES,
    RowTables,
    TileTables,
    row_columns,
    split_queries,
)

# tokens per mixed graph: padding stays under 256 tokens, whose compute (an 8B model: 4 TFLOP,
# ~6 ms on an H200 at 700 TFLOP/s) is less than an eager step's launches cost (11 ms for the
# 16 layers of Llama-3.2-1B's shape there); 192 and 384 hold a 128-token prompt beside 31 or
# 255 decodes (159 and 383 tokens) with less padding than 256 and 512
BUCKETS = (32, 64, 128, 192, 256, 384, *range(512, 2049, 256))


@dataclass
class MixedGraph:
    """One bucket's buffers, attention tables and (once captured) graph."""

    tokens: int  # the bucket: steps of fewer tokens replay it
    input_ids: torch.Tensor  # [1, tokens] long
    position_ids: torch.Tensor  # [1, tokens] long
    keep: torch.Tensor  # [kept] long: the packed rows whose logits the graph computes
    meta: AttentionMetadata  # its attention, over the static tables
    graph: Any = None  # torch.cuda.CUDAGraph, or a stand-in with replay()
    logits: torch.Tensor | None = None  # [kept, vocab], written by a replay

    @property
    def kept(self) -> int:
        return self.keep.shape[0]


class MixedGraphs:
    """The buckets of mixed steps of one CudaPaged backend, sharing its block tables."""

    def __init__(
        self,
        kv_cache: PagedKVCache,
        block_tables: torch.Tensor,  # [max requests, max_blocks] int32 (the decode graphs')
        spare_slot: int,
        max_kept: int,  # kept rows a graph holds at most (the largest decode graph's rows)
        splits: int | None,  # key ranges per row (None: as the rows kernel picks)
        buckets: tuple[int, ...] = BUCKETS,
    ) -> None:
        device = block_tables.device
        largest = max(buckets)
        self.block_tables = block_tables
        self.spare_slot = spare_slot
        # rows, row_request, row_lens; tiles' start, rows, request, lens: one bucket uses the
        # first `tokens` (tokens // ROW_QUERIES) of each, 16-byte aligned (aligned_int32)
        self.rows = torch.zeros(3, largest, dtype=torch.int32, device=device)
        self.tiles = torch.zeros(4, largest // ROW_QUERIES, dtype=torch.int32, device=device)
        self.slots = torch.full((largest,), spare_slot, dtype=torch.long, device=device)
        self.graphs: dict[int, MixedGraph] = {}
        with torch.inference_mode(False):  # plain tensors, as the decode graphs' inputs
            for tokens in sorted(buckets):  # ascending: pick takes the first that holds a step
                ids = torch.zeros(1, tokens, dtype=torch.long, device=device)
                num_tiles = tokens // ROW_QUERIES  # a tile holds more than ROW_QUERIES queries
                tables = RowTables(
                    rows=self.rows[0, :tokens],
                    row_request=self.rows[1, :tokens],
                    row_lens=self.rows[2, :tokens],
                    block_tables=block_tables,
                    tiles=TileTables(
                        self.tiles[0, :num_tiles],
                        self.tiles[1, :num_tiles],
                        self.tiles[2, :num_tiles],
                        self.tiles[3, :num_tiles],
                        TILE_QUERIES,
                    ),
                    splits=splits,
                )
                meta = AttentionMetadata(
                    kv_cache=kv_cache,
                    slot_mapping=self.slots[:tokens],
                    query_start=[],
                    context_lens=[],
                    context_slots=[],
                    prefill_indices=[],
                    rows=tables,
                )
                kept = max(2, min(tokens, max_kept))  # 2 or more: one traced shape for all
                keep = torch.arange(kept, device=device)
                self.graphs[tokens] = MixedGraph(tokens, ids, ids.clone(), keep, meta)

    def pick(self, batch: PackedBatch, kept: list[int]) -> MixedGraph | None:
        """The smallest captured bucket of more tokens than the step and room for its kept
        rows and requests (None: the step runs eagerly)."""
        num_tokens = batch.input_ids.shape[1]
        if batch.prompt_rows or len(batch.states) > self.block_tables.shape[0]:
            return None
        for tokens, graph in self.graphs.items():
            if tokens > num_tokens and graph.kept >= len(kept) and graph.graph is not None:
                return graph
        return None

    def fill(self, graph: MixedGraph, batch: PackedBatch, kept: list[int], block_size: int) -> int:
        """Copy the step into `graph`'s buffers: its tables, padded; its tokens and kept rows.
        Returns how many of its prompt chunks the tile kernel attends."""
        tokens = graph.tokens
        num_tokens = batch.input_ids.shape[1]
        short, long = split_queries(batch)
        columns = row_columns(batch, short, long, block_size, TILE_QUERIES)
        n = len(columns.rows)
        pad_rows = list(range(num_tokens, tokens))
        pad_rows += [tokens - 1] * (tokens - n - len(pad_rows))
        num_tiles = tokens // ROW_QUERIES
        pad_tiles = [0] * (num_tiles - len(columns.tiles[0]))
        staged = torch.tensor(
            columns.rows
            + pad_rows
            + columns.row_request
            + [0] * (tokens - n)
            + columns.row_lens
            + [0] * (tokens - n)
            + [value for column in columns.tiles for value in column + pad_tiles]
            + kept
            + columns.table,
            dtype=torch.int32,
        ).to(self.rows.device, non_blocking=True)
        self.rows[:, :tokens].copy_(staged[: 3 * tokens].view(3, tokens))
        at = 3 * tokens + 4 * num_tiles
        self.tiles[:, :num_tiles].copy_(staged[3 * tokens : at].view(4, num_tiles))
        graph.keep[: len(kept)].copy_(staged[at : at + len(kept)])
        table = staged[at + len(kept) :].view(len(columns.requests), columns.max_blocks)
        self.block_tables[: len(columns.requests), : columns.max_blocks].copy_(table)
        self.slots[:num_tokens].copy_(batch.slot_mapping)
        self.slots[num_tokens:tokens].fill_(self.spare_slot)
        graph.input_ids[0, :num_tokens].copy_(batch.input_ids[0])
        graph.position_ids[0, :num_tokens].copy_(batch.position_ids[0])
        return len(long)

    def pad(self, graph: MixedGraph) -> None:
        """Tables of padding alone (every row and tile skipped), for a capture."""
        tokens = graph.tokens
        self.rows[0, :tokens].copy_(torch.arange(tokens, device=self.rows.device))
        self.rows[1:, :tokens].zero_()
        self.tiles.zero_()
        self.slots[:tokens].fill_(self.spare_slot)

    def capture(
        self,
        run_model: Callable[..., torch.Tensor],
        capture: Callable[[Callable[[], torch.Tensor]], tuple[Any, torch.Tensor]],
    ) -> None:
        """Each bucket's graph, largest first (`capture` records a step function: its graph
        and logits)."""
        for tokens in sorted(self.graphs, reverse=True):
            graph = self.graphs[tokens]
            self.pad(graph)

            def step(graph: MixedGraph = graph) -> torch.Tensor:
                return run_model(graph.input_ids, graph.position_ids, graph.keep, graph.meta)

            graph.graph, graph.logits = capture(step)

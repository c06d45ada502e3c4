"""The tables the CUDA path's Triton attention kernels read for a step (services/worker/
triton_attention.py, triton_tiles.py): requests of at most ROW_QUERIES queries this step
(decodes, drafts, short chunks) as query rows, longer prompt chunks as tiles of at most
TILE_QUERIES consecutive queries, with the block tables of the requests they belong to. Eager
steps copy them to the device in one copy (`row_tables`); the graphs of mixed steps copy them
into their static buffers (services/worker/mixed_graphs.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from services.worker.kv_cache import PagedKVCache

if TYPE_CHECKING:
    from services.worker.backends import PackedBatch

TILE_QUERIES = 64  # queries per tile of a longer prompt chunk (the tile kernel's BLOCK_M)
ROW_QUERIES = 16  # requests with at most this many queries this step are kernel rows
INT32_PER_16_BYTES = 4  # the tables' alignment (`aligned_int32`)


@dataclass
class TileTables:
    """Prompt chunks cut into tiles of at most `block_m` consecutive queries of one request,
    each tile attended by one program of the Triton tile kernel (CUDA)."""

    start: torch.Tensor  # [num_tiles] int32 packed token of the tile's first query
    rows: torch.Tensor  # [num_tiles] int32 queries in the tile
    request: torch.Tensor  # [num_tiles] int32 the tile's request (its block_tables row)
    lens: torch.Tensor  # [num_tiles] int32 keys the tile's first query sees (causal)
    block_m: int  # queries per tile at most (the kernel's BLOCK_M)


@dataclass
class RowTables:
    """Queries attended in place over the paged cache by the Triton kernels (CUDA): decodes and
    short chunks as rows, a query each; longer prompt chunks as `tiles`."""

    rows: torch.Tensor  # [num_rows] int32 packed token of each row
    row_request: torch.Tensor  # [num_rows] int32 the row's request (its block_tables row)
    row_lens: torch.Tensor  # [num_rows] int32 keys the row sees (causal)
    block_tables: torch.Tensor  # [num_requests, max_blocks] int32 block ids
    tiles: TileTables | None = None  # the longer chunks' queries (None: there are none)
    splits: int | None = None  # key ranges per row (None: as attend_rows picks)

    def attend(self, out, query, k_cache, v_cache, block_size, scaling, sliding_window) -> None:
        # Triton: only where this runs (CUDA)
        from services.worker import triton_attention, triton_tiles

        if self.rows.shape[0]:
            triton_attention.attend_rows(
                out,
                query,
                k_cache,
                v_cache,
                self.rows,
                self.row_request,
                self.row_lens,
                self.block_tables,
                block_size,
                scaling,
                sliding_window,
                self.splits,
            )
        tiles = self.tiles
        if tiles is not None:
            triton_tiles.attend_tiles(
                out,
                query,
                k_cache,
                v_cache,
                tiles.start,
                tiles.rows,
                tiles.request,
                tiles.lens,
                self.block_tables,
                block_size,
                scaling,
                sliding_window,
                tiles.block_m,
            )


def split_queries(batch: PackedBatch) -> tuple[list[int], list[int]]:
    """The step's requests (indices) of at most ROW_QUERIES queries, then the longer ones."""
    starts = batch.query_start
    q_lens = [end - start for start, end in zip(starts, starts[1:])]
    short = [i for i, q_len in enumerate(q_lens) if q_len <= ROW_QUERIES]
    return short, [i for i, q_len in enumerate(q_lens) if q_len > ROW_QUERIES]


@dataclass
class RowColumns:
    """What the Triton kernels' tables hold for a step, as lists (`row_tables` puts them on
    the device; services/worker/mixed_graphs.py copies them into a graph's buffers)."""

    rows: list[int]  # packed token of each row
    row_request: list[int]  # the row's request (its index in `requests`)
    row_lens: list[int]  # keys the row sees
    tiles: list[list[int]]  # start, rows, request, lens of each tile
    requests: list[int]  # the step's requests (indices) in table order: short, then long
    table: list[int]  # their block tables, row-major, padded to `max_blocks`
    max_blocks: int


def row_columns(
    batch: PackedBatch, short: list[int], long: list[int], block_size: int, block_m: int
) -> RowColumns:
    """One row per query of each of the `short` requests (indices into the step), with its
    causal key count, and tiles of at most `block_m` queries of each of the `long` ones."""
    rows: list[int] = []
    row_request: list[int] = []
    row_lens: list[int] = []
    for index, i in enumerate(short):
        start, end = batch.query_start[i], batch.query_start[i + 1]
        context_len = batch.context_lens[i]
        rows.extend(range(start, end))
        row_request.extend([index] * (end - start))
        row_lens.extend(range(context_len - (end - start) + 1, context_len + 1))
    tiles: list[list[int]] = [[], [], [], []]  # start, rows, request, lens
    for index, i in enumerate(long, start=len(short)):
        start, end = batch.query_start[i], batch.query_start[i + 1]
        first_len = batch.context_lens[i] - (end - start) + 1
        for offset in range(0, end - start, block_m):
            tiles[0].append(start + offset)
            tiles[1].append(min(block_m, end - start - offset))
            tiles[2].append(index)
            tiles[3].append(first_len + offset)
    requests = short + long
    table, max_blocks = PagedKVCache.padded_block_tables(
        [batch.block_tables[i] for i in requests],
        [batch.context_lens[i] for i in requests],
        block_size,
    )
    return RowColumns(rows, row_request, row_lens, tiles, requests, table, max_blocks)


def row_tables(
    batch: PackedBatch,  # the step (its query_start, context_lens and block_tables)
    short: list[int],
    long: list[int],
    block_size: int,
    device: torch.device,
    block_m: int = TILE_QUERIES,
) -> RowTables:
    """`row_columns` on the device, in one copy."""
    columns = row_columns(batch, short, long, block_size, block_m)
    rows, row_request, row_lens, tile_start, tile_rows, tile_request, tile_lens, table = (
        aligned_int32(
            [columns.rows, columns.row_request, columns.row_lens, *columns.tiles, columns.table],
            device,
        )
    )
    return RowTables(
        rows=rows,
        row_request=row_request,
        row_lens=row_lens,
        block_tables=table.view(len(columns.requests), columns.max_blocks),
        tiles=TileTables(tile_start, tile_rows, tile_request, tile_lens, block_m)
        if columns.tiles[0]
        else None,
    )


def aligned_int32(columns: list[list[int]], device: torch.device) -> list[torch.Tensor]:
    """The columns as int32 tensors on `device`, from one copy, each starting on a 16-byte
    boundary: Triton builds a kernel again for each new alignment of a pointer argument (16
    bytes or not), and tables packed end to end have offsets that follow the step's row and tile
    counts: each new combination of the seven tables' alignments would build the kernels
    again (the likely cause of the 0.3-0.8 s stalls in the first steps of a served run on an
    H200)."""
    flat: list[int] = []
    bounds: list[tuple[int, int]] = []
    for column in columns:
        bounds.append((len(flat), len(flat) + len(column)))
        flat.extend(column)
        flat.extend([0] * (-len(flat) % INT32_PER_16_BYTES))
    packed = torch.tensor(flat, dtype=torch.int32).to(device)
    return [packed[start:end] for start, end in bounds]

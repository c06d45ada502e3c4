"""Paged attention for transformers' own modeling code.

The runner packs every scheduled token of every request into one sequence
(input_ids [1, num_tokens], explicit position_ids) and passes an `AttentionMetadata` as the
keyword argument `textgen_attention`; transformers hands it to the attention function below,
registered under ATTENTION_NAME through `AttentionInterface`. For each layer it writes the new
keys/values into the cache by slot mapping, then attends each request's queries over all of
that request's cached tokens:

    packed queries:  | r0: 5 prompt tokens | r1: 1 decode | r2: chunk of 3 |
    query_start:     0                     5              6                9
    context_lens:    5                     37             19   (tokens in cache after the write)

Query j of a request with q_len queries and context_len keys sits at position
context_len - q_len + j and sees keys 0..that position (causal).

Decodes (one query each) are attended together in one call over their block tables padded to
the longest context (`DecodeGroup`): whole blocks are gathered (one row copy per block, not
one per token), and on CPU in half precision the attention is two batched matmuls with a
float32 softmax (PyTorch's CPU flash kernel is several times slower there). Prompt chunks are
attended one request at a time. On CUDA (services/worker/cuda_graphs.py) every query goes
through Triton kernels that read the blocks in place (`RowTables`, services/worker/row_tables.py;
services/worker/triton_attention.py, triton_tiles.py): decodes and short chunks as rows,
longer prompt chunks as tiles of consecutive queries; with flash-attn installed a layer's
attention is one flash_attn_varlen_func call instead (services/worker/flash_attention.py).

Under torch.compile (the CUDA path's graphs and eager steps) the keyword argument is IN_GRAPH
instead and the metadata sits in GRAPH_STEP: each layer's attention is then one custom
operator, `textgen::paged_attention`, that dynamo does not trace into, so inductor fuses the
modules' element-wise work around it while the attention runs as above.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from services.worker import flash_attention
from services.worker.kv_cache import PagedKVCache
from services.worker.row_tables import RowTables

ATTENTION_NAME = "textgen_paged"
METADATA_KWARG = "textgen_attention"


@dataclass
class DecodeGroup:
    rows: torch.Tensor  # [num_decodes] packed index of each decode query
    blocks: torch.Tensor  # [num_decodes * max_blocks] block tables, row-major, padded with 0
    max_blocks: int  # blocks per padded row; keys per row = max_blocks * block_size
    mask: torch.Tensor  # [num_decodes, 1, 1, max_blocks * block_size] True on real keys


@dataclass
class AttentionMetadata:
    kv_cache: PagedKVCache
    slot_mapping: torch.Tensor  # [num_tokens] cache slot of each packed token
    query_start: list[int]  # [num_requests + 1] offsets of each request's queries
    context_lens: list[int]  # [num_requests] cached tokens per request after this step
    context_slots: list[torch.Tensor]  # per request: [context_len] slots (empty: flash path)
    decodes: DecodeGroup | None = None  # single-query requests, attended together
    rows: RowTables | None = None  # CUDA: queries through the Triton kernels
    prefill_indices: list[int] | None = None  # requests attended one by one (None: all)
    # set on CUDA with flash-attn: every request attended in one flash_attn_varlen_func call
    flash: flash_attention.FlashMetadata | None = None


def make_decode_group(
    rows: list[int],
    block_tables: list[list[int]],
    context_lens: list[int],
    block_size: int,
    device: torch.device,
) -> DecodeGroup:
    """Pad the decodes' block tables (each cut to the blocks its context fills) to the
    longest one."""
    table, max_blocks = PagedKVCache.padded_block_tables(block_tables, context_lens, block_size)
    lengths = torch.tensor(context_lens)
    mask = torch.arange(max_blocks * block_size)[None, :] < lengths[:, None]
    return DecodeGroup(
        rows=torch.tensor(rows, dtype=torch.long, device=device),
        blocks=torch.tensor(table, dtype=torch.long, device=device),
        max_blocks=max_blocks,
        mask=mask[:, None, None, :].to(device),
    )


def _gather_blocks(cache: torch.Tensor, group: DecodeGroup, block_size: int) -> torch.Tensor:
    """The group's keys (or values) from one layer's cache. [n, max_len, kv_heads, head_dim]"""
    num_slots, kv_heads, head_dim = cache.shape
    rows = cache.view(num_slots // block_size, -1).index_select(0, group.blocks)
    return rows.view(len(group.rows), group.max_blocks * block_size, kv_heads, head_dim)


def _causal_mask(q_len: int, context_len: int, sliding_window: int | None, device) -> torch.Tensor:
    """[q_len, context_len] True where a query may attend."""
    query_pos = torch.arange(context_len - q_len, context_len, device=device)[:, None]
    key_pos = torch.arange(context_len, device=device)[None, :]
    mask = key_pos <= query_pos
    if sliding_window:
        mask &= key_pos > query_pos - sliding_window
    return mask


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, num_heads, num_tokens, head_dim]
    key: torch.Tensor,  # [1, num_kv_heads, num_tokens, head_dim]
    value: torch.Tensor,  # [1, num_kv_heads, num_tokens, head_dim]
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    meta: AttentionMetadata | str = kwargs[METADATA_KWARG]
    if softcap:
        raise NotImplementedError("attention logit soft-capping is not supported yet")
    layer: int = module.layer_idx  # type: ignore[assignment]  # an int set by transformers
    if isinstance(meta, str):  # IN_GRAPH: torch.compile sees one opaque op per layer
        scale = query.shape[-1] ** -0.5 if scaling is None else scaling
        return in_graph_attention(query, key, value, layer, scale, sliding_window or 0), None
    return attend(meta, layer, query, key, value, scaling, sliding_window), None


# the metadata of the step being traced, captured or run through IN_GRAPH (set by the caller:
# services/worker/cuda_graphs.py)
IN_GRAPH = "in-graph"  # METADATA_KWARG's value: the metadata is GRAPH_STEP[0]
GRAPH_STEP: list[AttentionMetadata | None] = [None]


@torch.library.custom_op("textgen::paged_attention", mutates_args=())
def in_graph_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layer: int,
    scaling: float,
    sliding_window: int,
) -> torch.Tensor:
    """`attend` as one operator that torch.compile does not look into (it writes the cache and
    launches the Triton kernel), over the metadata in GRAPH_STEP."""
    meta = GRAPH_STEP[0]
    assert meta is not None, "no graph step is set"
    return attend(meta, layer, query, key, value, scaling, sliding_window or None)


@in_graph_attention.register_fake
def _in_graph_attention_shape(query, key, value, layer, scaling, sliding_window):
    return query.new_empty(1, query.shape[2], query.shape[1], query.shape[3])


def attend(
    meta: AttentionMetadata,
    layer: int,
    query: torch.Tensor,  # [1, num_heads, num_tokens, head_dim]
    key: torch.Tensor,  # [1, num_kv_heads, num_tokens, head_dim]
    value: torch.Tensor,
    scaling: float | None,
    sliding_window: int | None,
) -> torch.Tensor:
    """Write the step's keys and values of `layer` into the cache, then attend every query
    over its request's cached tokens. [1, num_tokens, num_heads, head_dim]"""
    k_cache = meta.kv_cache.keys[layer]  # [num_slots, num_kv_heads, head_dim]
    v_cache = meta.kv_cache.values[layer]
    k_cache.index_copy_(0, meta.slot_mapping, key[0].transpose(0, 1).to(k_cache.dtype))
    v_cache.index_copy_(0, meta.slot_mapping, value[0].transpose(0, 1).to(v_cache.dtype))
    if meta.flash is not None:
        q = query[0].transpose(0, 1)  # [num_tokens, num_heads, head_dim]
        out = flash_attention.attend(q, k_cache, v_cache, meta.flash, scaling, sliding_window)
        return out.unsqueeze(0)

    num_tokens = query.shape[2]
    out = torch.empty(
        num_tokens, query.shape[1], query.shape[3], dtype=query.dtype, device=query.device
    )  # [num_tokens, num_heads, head_dim]
    if meta.rows is not None:
        q = query[0].transpose(0, 1)  # [num_tokens, num_heads, head_dim]
        meta.rows.attend(
            out, q, k_cache, v_cache, meta.kv_cache.block_size, scaling, sliding_window
        )
    if meta.decodes is not None:
        _attend_decodes(
            meta.decodes,
            query,
            k_cache,
            v_cache,
            meta.kv_cache.block_size,
            out,
            scaling,
            sliding_window,
        )
    indices = meta.prefill_indices
    for i in range(len(meta.context_lens)) if indices is None else indices:
        context_len = meta.context_lens[i]
        start, end = meta.query_start[i], meta.query_start[i + 1]
        q = query[0, :, start:end]  # [num_heads, q_len, head_dim]
        slots = meta.context_slots[i]
        k = k_cache[slots].transpose(0, 1).to(q.dtype)  # [num_kv_heads, context_len, head_dim]
        v = v_cache[slots].transpose(0, 1).to(q.dtype)
        q_len = end - start
        is_full_causal = q_len == context_len and not sliding_window
        mask = None
        if q_len > 1 and not is_full_causal or (sliding_window and context_len > sliding_window):
            mask = _causal_mask(q_len, context_len, sliding_window, q.device)
        attended = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            is_causal=is_full_causal,
            scale=scaling,
            enable_gqa=q.shape[0] != k.shape[0],
        )  # [num_heads, q_len, head_dim]
        out[start:end] = attended.transpose(0, 1)
    return out.unsqueeze(0)


def _attend_decodes(
    group: DecodeGroup,
    query: torch.Tensor,  # [1, num_heads, num_tokens, head_dim]
    k_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_size: int,
    out: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    scaling: float | None,
    sliding_window: int | None,
) -> None:
    q = query[0][:, group.rows].transpose(0, 1)  # [n, num_heads, head_dim]
    k = _gather_blocks(k_cache, group, block_size).to(q.dtype)  # [n, max_len, kv, head_dim]
    v = _gather_blocks(v_cache, group, block_size).to(q.dtype)
    mask = group.mask  # [n, 1, 1, max_len]
    if sliding_window:
        lengths = mask.sum(-1, keepdim=True)  # [n, 1, 1, 1]
        positions = torch.arange(mask.shape[-1], device=mask.device)
        mask = mask & (positions > lengths - 1 - sliding_window)
    n, num_heads, head_dim = q.shape
    if q.device.type == "cpu" and q.dtype != torch.float32:
        kv_heads = k.shape[2]
        grouped = q.view(n, kv_heads, num_heads // kv_heads, head_dim)
        scores = torch.matmul(grouped, k.permute(0, 2, 3, 1)).float()  # [n, kv, group, max_len]
        scores = scores.mul_(head_dim**-0.5 if scaling is None else scaling)
        weights = scores.masked_fill_(~mask, float("-inf")).softmax(-1).to(q.dtype)
        attended = torch.matmul(weights, v.transpose(1, 2))  # [n, kv, group, head_dim]
        out[group.rows] = attended.reshape(n, num_heads, head_dim)
        return
    attended = F.scaled_dot_product_attention(
        q.unsqueeze(2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=mask,
        scale=scaling,
        enable_gqa=num_heads != k.shape[2],
    )  # [n, num_heads, 1, head_dim]
    out[group.rows] = attended[:, :, 0]


def register() -> None:
    """Make ATTENTION_NAME usable as `attn_implementation` (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)

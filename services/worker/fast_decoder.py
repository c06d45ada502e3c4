"""A hand-written forward pass for Llama-shaped decoders on the CPU (Llama, Mistral, Qwen2,
and checkpoints of their shape such as SmolLM2), over the same paged KV cache and packed
batch as the generic path.

Why: transformers' modules spend most of a CPU decode step outside the matmuls (at batch 32
on a SmolLM2-135M shape, 134 ms per step of which the linear layers' useful work is ~25 ms):
oneDNN re-packs every bfloat16 weight at each call, and each layer runs ~60 small ops. Here a
layer is four matmuls on weights packed once at load (q/k/v fused, gate/up fused) and four
kernels (services/worker/kernels):

    x -> rms_norm -> qkv matmul -> rope_store (rotate q, k; write k, v to the cache)
      -> paged_attention -> o matmul -> rms_norm(+ residual) -> gate_up matmul -> silu_mul
      -> down matmul -> (residual added by the next layer's rms_norm)

On the float32 kernel and the bfloat16 dot-product one the gate_up matmul computes silu_mul on
its sums itself (one pass, the product never in memory: PackedLinear.silu_mul), unless a LoRA
adapter adds to the product.

Each op rounds as transformers' does (bfloat16 results of float32 arithmetic), so outputs
stay equal to transformers' generate; only reduction orders differ (the norm's mean, the
attention's softmax), as between any two kernels. The model's own rotary embedding module
gives cos/sin, so every rope scaling variant is the model's.

The KV cache keeps the worker's allocation ([num_slots, num_kv_heads, head_dim] per layer) but
the decoder, its only reader and writer, lays each block out head-major with keys transposed
(services/worker/kernels/cpu_kernels.c draws it), so the attention kernel reads a tile of keys
as contiguous rows.

Used when the model is one of these architectures with SiLU MLPs, float32 or bfloat16, on one
CPU rank, unquantized, and the kernels build (`build()` says why not otherwise). Building it
moves the linear weights into the packed layout: the transformers module keeps only its
embeddings, norms and rotary embedding afterwards.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from services.worker import dense_prefill, huge_pages, kernels, packed_linear
from services.worker.dense_prefill import AttentionSplit, attend_dense
from services.worker.fused_layers import llama_shaped_reason, sliding_window
from services.worker.kernels.tile_attention import TileAttention
from services.worker.kv_cache import PagedKVCache
from services.worker.lora import LoraOp, LoraSet
from services.worker.packed_linear import PackedLinear, pack

log = logging.getLogger(__name__)

FAST_DECODER = "cpu-kernels"  # the attention name the worker reports (/info model_attention)


@dataclass
class StepTables:
    """One step's request layout for the attention kernel, built once for all layers."""

    query_start: torch.Tensor  # [num_requests + 1] int64 offsets of each request's queries
    context_lens: torch.Tensor  # [num_requests] int64 keys cached per request after the step
    block_tables: torch.Tensor  # [num_requests, max_blocks] int64 block ids, padded with 0
    slot_mapping: torch.Tensor  # [num_tokens] int64 cache slot of each packed token
    split: AttentionSplit  # chunks that attend densely, and the kernel's tables for the rest

    @classmethod
    def build(
        cls,
        query_start: list[int],
        context_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        slot_mapping: torch.Tensor,
        dense_min_keys: int | None = 0,  # dense_prefill.min_keys
        dense_min_queries: int = dense_prefill.DENSE_MIN_QUERIES,  # FastDecoder's
    ) -> StepTables:
        table, max_blocks = PagedKVCache.padded_block_tables(block_tables, context_lens, block_size)
        tables = torch.tensor(table, dtype=torch.int64).view(len(context_lens), -1)
        starts = torch.tensor(query_start, dtype=torch.int64)
        lens = torch.tensor(context_lens, dtype=torch.int64)
        return cls(
            query_start=starts,
            context_lens=lens,
            block_tables=tables,
            slot_mapping=slot_mapping,
            split=AttentionSplit.of(
                query_start, context_lens, tables, starts, lens, dense_min_keys, dense_min_queries
            ),
        )


@dataclass
class Layer:
    input_norm: torch.Tensor  # [hidden] RMSNorm weight before attention
    qkv: PackedLinear  # hidden -> (num_heads + 2 * num_kv_heads) * head_dim
    o: PackedLinear  # num_heads * head_dim -> hidden
    post_norm: torch.Tensor  # [hidden] RMSNorm weight before the MLP
    gate_up: PackedLinear  # hidden -> 2 * intermediate
    down: PackedLinear  # intermediate -> hidden
    sliding_window: int | None  # keys a query sees (its own included); None: all before it
    scaling: float  # of the attention scores


def unsupported_reason(
    model: Any, device: torch.device, quantize: str | None, world_size: int
) -> str | None:
    """Why the fast decoder cannot run this model, or None when it can."""
    config = model.config
    if device.type != "cpu":
        return f"it runs on the CPU only, not {device.type}"
    reason = llama_shaped_reason(model, quantize, world_size)
    if reason is not None:
        return reason
    if getattr(config, "hidden_act", None) != "silu" or getattr(config, "mlp_bias", False):
        return "its MLP is not a bias-free SiLU gate"
    dtype = model.dtype
    if not kernels.CpuKernels.supports(dtype):
        return f"{dtype} is not float32 or bfloat16"
    if not packed_linear.supports(dtype):
        return f"oneDNN cannot run {dtype} matmuls here"
    decoder = getattr(model, "model", None)
    if decoder is None or not hasattr(decoder, "rotary_emb") or not hasattr(decoder, "layers"):
        return f"{type(model).__name__} is not laid out as a Llama"
    head_dim = decoder.layers[0].self_attn.head_dim
    if head_dim % kernels.KEY_TILE or head_dim > kernels.MAX_HEAD_DIM:
        return (
            f"its head dimension {head_dim} is not a multiple of {kernels.KEY_TILE} "
            f"up to {kernels.MAX_HEAD_DIM}"
        )
    return None


class FastDecoder:
    """`decoder(input_ids, position_ids, tables, kv_cache, keep_rows)` -> the logits of the
    kept rows, for a batch packed as one sequence (services/worker/runner.py)."""

    def __init__(self, model: Any, ops: kernels.CpuKernels) -> None:
        """`model`: a transformers Llama-shaped model, its parts read by name."""
        self.ops = ops
        config = model.config
        decoder = model.model
        self.rotary = decoder.rotary_emb
        self.embed: torch.Tensor = decoder.embed_tokens.weight.detach()  # [vocab, hidden]
        self.norm: torch.Tensor = decoder.norm.weight.detach()
        self.eps: float = decoder.norm.variance_epsilon
        self.num_heads: int = (
            config.num_attention_heads
        )  # the kernels take the KV shape from the cache
        # the matmuls LoRA adapters may add to, by the module names PEFT gives their parts
        self.lora_ops: dict[str, LoraOp] = {}
        self.lora: LoraSet | None = None  # the worker's adapters, once attached
        # the packed weights of textgen's own matmuls, on huge pages: a decode step streams them
        self.arena = huge_pages.HugePageArena()
        self.layers = [
            self._layer(index, layer, config) for index, layer in enumerate(decoder.layers)
        ]
        # long prompt chunks attend with torch's fused attention where it is the faster
        self.dense_min_keys = dense_prefill.min_keys(ops.level, self.embed.dtype)
        # the AMX attention kernel, where it takes this model's chunks (None: torch's attention)
        tiles = ops.tile_attention
        head_dim = decoder.layers[0].self_attn.head_dim
        takes = tiles is not None and tiles.takes(self.embed.dtype, head_dim)
        self.tiles: TileAttention | None = tiles if takes else None
        # ... and dense from how many queries: fewer on the tiles
        self.dense_min_queries = (
            dense_prefill.TILE_MIN_QUERIES if takes else dense_prefill.DENSE_MIN_QUERIES
        )
        self.lm_head = PackedLinear(
            model.get_output_embeddings().weight.detach(), ops=ops, arena=self.arena
        )
        head = model.get_output_embeddings()
        if head.weight.data_ptr() != self.embed.data_ptr():  # untied: release the copy
            head.weight = torch.nn.Parameter(head.weight.new_empty(0), requires_grad=False)

    def _attend(
        self,
        qkv: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        tables: StepTables,
        layer: Layer,
        block_size: int,
    ) -> torch.Tensor:
        """Causal attention of every row: whole-context prompt chunks densely
        (dense_prefill.py), the others with the paged kernel. [num_tokens, heads * head_dim]"""
        split, ops = tables.split, self.ops
        window = layer.sliding_window
        too_wide = window is not None and split.longest_dense > window
        if not split.dense or too_wide:
            return ops.paged_attention(
                qkv,
                k_cache,
                v_cache,
                tables.query_start,
                tables.context_lens,
                tables.block_tables,
                block_size,
                self.num_heads,
                layer.scaling,
                window,
            )
        head_dim = k_cache.shape[2]
        out = qkv.new_empty(qkv.shape[0], self.num_heads * head_dim)
        attend_dense(
            qkv,
            out,
            split,
            k_cache,
            v_cache,
            block_size,
            self.num_heads,
            layer.scaling,
            tiles=self.tiles,
        )
        if split.paged_rows is not None and len(split.paged_rows):
            paged = ops.paged_attention(
                qkv.index_select(0, split.paged_rows),
                k_cache,
                v_cache,
                split.query_start,
                split.context_lens,
                split.block_tables,
                block_size,
                self.num_heads,
                layer.scaling,
                window,
            )
            out.index_copy_(0, split.paged_rows, paged)
        return out

    def _lora_op(self, key: str, prefix: str, *linears: tuple[str, torch.nn.Linear]) -> None:
        parts = tuple((f"{prefix}.{name}", linear.out_features) for name, linear in linears)
        self.lora_ops[key] = LoraOp(key, parts, linears[0][1].in_features)

    def _layer(self, index: int, layer: Any, config: Any) -> Layer:
        attention, mlp = layer.self_attn, layer.mlp
        prefix = f"model.layers.{index}"  # transformers' (and PEFT's) module names
        self._lora_op(
            f"{index}.qkv",
            f"{prefix}.self_attn",
            ("q_proj", attention.q_proj),
            ("k_proj", attention.k_proj),
            ("v_proj", attention.v_proj),
        )
        self._lora_op(f"{index}.o", f"{prefix}.self_attn", ("o_proj", attention.o_proj))
        self._lora_op(
            f"{index}.gate_up",
            f"{prefix}.mlp",
            ("gate_proj", mlp.gate_proj),
            ("up_proj", mlp.up_proj),
        )
        self._lora_op(f"{index}.down", f"{prefix}.mlp", ("down_proj", mlp.down_proj))
        arena = self.arena
        return Layer(
            input_norm=layer.input_layernorm.weight.detach(),
            qkv=pack(self.ops, attention.q_proj, attention.k_proj, attention.v_proj, arena=arena),
            o=pack(self.ops, attention.o_proj, arena=arena),
            post_norm=layer.post_attention_layernorm.weight.detach(),
            gate_up=pack(self.ops, mlp.gate_proj, mlp.up_proj, gated=True, arena=arena),
            down=pack(self.ops, mlp.down_proj, arena=arena),
            sliding_window=sliding_window(attention, config),
            scaling=attention.scaling,
        )

    @torch.inference_mode()
    def __call__(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        position_ids: torch.Tensor,  # [num_tokens]
        tables: StepTables,
        kv_cache: PagedKVCache,
        keep_rows: torch.Tensor,  # [num_kept] packed rows whose logits are wanted
    ) -> torch.Tensor:  # [num_kept, vocab]
        ops = self.ops
        block_size = kv_cache.block_size
        hidden = F.embedding(input_ids, self.embed)  # [num_tokens, hidden]
        cos, sin = self.rotary(hidden, position_ids[None])  # [1, num_tokens, head_dim] each
        cos, sin = cos[0].contiguous(), sin[0].contiguous()
        residual = hidden.clone()  # the skip connection's running sum
        x = ops.rms_norm(hidden, self.layers[0].input_norm, self.eps)
        lora = self.lora if self.lora is not None and self.lora.step is not None else None
        for index, layer in enumerate(self.layers):
            k_cache, v_cache = kv_cache.keys[index], kv_cache.values[index]
            qkv = layer.qkv(x)  # [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim]
            if lora:
                lora.add(f"{index}.qkv", x, qkv)
            ops.rope_store(
                qkv, cos, sin, k_cache, v_cache, tables.slot_mapping, self.num_heads, block_size
            )
            attended = self._attend(qkv, k_cache, v_cache, tables, layer, block_size)
            attention_out = layer.o(attended)
            if lora:
                lora.add(f"{index}.o", attended, attention_out)
            x = ops.rms_norm(attention_out, layer.post_norm, self.eps, residual=residual)
            if lora:
                gate_up = layer.gate_up(x)
                lora.add(f"{index}.gate_up", x, gate_up)
                activated = ops.silu_mul(gate_up)
            else:  # in one pass where the matmul fuses them
                activated = layer.gate_up.silu_mul(x, ops)
            mlp_out = layer.down(activated)
            if lora:
                lora.add(f"{index}.down", activated, mlp_out)
            if index + 1 < len(self.layers):
                x = ops.rms_norm(
                    mlp_out, self.layers[index + 1].input_norm, self.eps, residual=residual
                )
        kept = mlp_out.index_select(0, keep_rows)
        summed = residual.index_select(0, keep_rows)
        return self.lm_head(ops.rms_norm(kept, self.norm, self.eps, residual=summed))


def build(
    model: Any,
    device: torch.device,
    quantize: str | None,
    world_size: int,
    ops: kernels.CpuKernels | None,
) -> FastDecoder | None:
    """The fast decoder for `model` on the CPU kernels `ops`, or None (with the reason logged)
    where it cannot run; building it moves the model's linear weights into the decoder."""
    reason = unsupported_reason(model, device, quantize, world_size)
    if reason is None and ops is None:
        reason = "the CPU kernels are off (--disable-cpu-kernels) or could not be built"
    if reason is not None or ops is None:
        log.info("fast CPU decoder not used: %s", reason)
        return None
    decoder = FastDecoder(model, ops)
    linears = [decoder.lm_head]
    for layer in decoder.layers:
        linears += [layer.qkv, layer.o, layer.gate_up, layer.down]
    kinds = Counter(linear.kind for linear in linears)
    granted = huge_pages.granted_bytes()
    log.info(
        "fast CPU decoder: %d layers, %s, matmuls on packed weights (%s); %.0f MiB of them in "
        "chunks advised onto huge pages (%.0f MiB), %s MiB of the process's memory on huge pages",
        len(decoder.layers),
        model.dtype,
        ", ".join(f"{kind} {count}" for kind, count in sorted(kinds.items())),
        decoder.arena.num_bytes / 2**20,
        decoder.arena.advised_bytes / 2**20,
        "?" if granted is None else f"{granted / 2**20:.0f}",
    )
    return decoder

"""The q/k/v and gate/up projections of Llama-shaped decoders, each fused into one matmul inside
transformers' own modules, for the paths that run those modules (the GPU's, and the CPU's where
the fast decoder does not run).

Why: a decode step of a small model on a GPU is a chain of matrix-vector products, and the
small ones cost their launch and ramp-up rather than their bytes (on an H100 the 1B shape's
k and v projections, 2 MiB each, take about as long as its 8 MiB q projection). One matmul over
the concatenated weights reads the same bytes in 4 launches per layer instead of 7, as vLLM's
QKVParallelLinear and MergedColumnParallelLinear do:

    x -> qkv_proj -> split(q, k, v) -> rotary -> paged attention -> o_proj
    x -> gate_up_proj -> chunk(gate, up) -> act(gate) * up -> down_proj

Each fused weight is one FusedLinear (an nn.Linear whose `parts` name the projections it holds,
in output column order: LoRA adapters, which target the original names, add to those columns:
services/worker/lora.py); the original Linear modules are removed, so the weights are held
once. The attention and MLP modules keep their names and everything else; only their forward
is ours, doing what transformers' does with the fused outputs. Each output column is the same
dot product as before the fusion, so greedy outputs stay transformers'.

Used on the architectures the fast decoder runs (Llama, Mistral, Qwen2), unquantized, on one
rank (a tensor-parallel plan shards each projection on its own); `unfusable_reason` says why
not otherwise.
"""

from __future__ import annotations

import logging
import sys
import types
from typing import Any

import torch
from torch import nn

log = logging.getLogger(__name__)

ARCHITECTURES = ("llama", "mistral", "qwen2")  # config.model_type values of Llama's shape

QKV = ("q_proj", "k_proj", "v_proj")  # transformers' (and PEFT's) names of what each fuses
GATE_UP = ("gate_proj", "up_proj")


class FusedLinear(nn.Linear):
    """Several bias-alike Linear layers of one input, concatenated along their outputs."""

    parts: tuple[tuple[str, int], ...]  # (attribute name it replaced, out features), in order

    @classmethod
    def of(cls, module: nn.Module, names: tuple[str, ...]) -> FusedLinear:
        """The fusion of `module`'s Linear children `names`, which it removes."""
        linears = [getattr(module, name) for name in names]
        first = linears[0]
        fused = cls(
            first.in_features,
            sum(linear.out_features for linear in linears),
            bias=first.bias is not None,
            device="meta",
        )
        with torch.no_grad():
            fused.weight = nn.Parameter(
                torch.cat([linear.weight for linear in linears]), requires_grad=False
            )
            if first.bias is not None:
                fused.bias = nn.Parameter(
                    torch.cat([linear.bias for linear in linears]), requires_grad=False
                )
        fused.parts = tuple((name, linear.out_features) for name, linear in zip(names, linears))
        for name in names:
            delattr(module, name)
        return fused

    @property
    def widths(self) -> list[int]:
        return [width for _, width in self.parts]


def llama_shaped_reason(model: Any, quantize: str | None, world_size: int) -> str | None:
    """Why `model` is not a Llama-shaped decoder of plain weights on one rank (what the fused
    layers and the fast CPU decoder take), or None when it is."""
    config = model.config
    if getattr(config, "model_type", None) not in ARCHITECTURES:
        return f"{config.model_type} is not one of {', '.join(ARCHITECTURES)}"
    if quantize or getattr(config, "quantization_config", None):
        return "the model is quantized"
    if world_size > 1:
        return "the model is sharded over tensor-parallel ranks"
    return None


def sliding_window(attention: Any, config: Any) -> int | None:
    """The keys a query of this attention layer sees (its own included); None: all before it.
    Qwen2 keeps it per layer, Mistral reads it from the config, Llama has none."""
    if hasattr(attention, "sliding_window"):
        return attention.sliding_window
    return getattr(config, "sliding_window", None)


def unfusable_reason(model: Any, quantize: str | None, world_size: int) -> str | None:
    """Why `model`'s projections cannot be fused, or None when they can."""
    reason = llama_shaped_reason(model, quantize, world_size)
    if reason is not None:
        return reason
    for layer in model.model.layers:
        attention, mlp = layer.self_attn, layer.mlp
        for module, names in ((attention, QKV), (mlp, GATE_UP)):
            linears = [getattr(module, name, None) for name in names]
            if not all(type(linear) is nn.Linear for linear in linears):
                return "its projections are not plain Linear layers"
            if len({getattr(linear, "bias", None) is None for linear in linears}) > 1:
                return "some of its projections have a bias and others not"
        if not hasattr(mlp, "act_fn"):
            return "its MLP has no act_fn"
    return None


def fuse(model: Any, quantize: str | None = None, world_size: int = 1) -> bool:
    """Fuse every decoder layer's q/k/v and gate/up projections of `model` in place; False
    (the reason logged) where they cannot be."""
    reason = unfusable_reason(model, quantize, world_size)
    if reason is not None:
        log.info("projections not fused: %s", reason)
        return False
    for layer in model.model.layers:
        attention, mlp = layer.self_attn, layer.mlp
        attention.qkv_proj = FusedLinear.of(attention, QKV)
        attention.rotate = sys.modules[type(attention).__module__].apply_rotary_pos_emb
        attention.forward = types.MethodType(_attention_forward, attention)
        mlp.gate_up_proj = FusedLinear.of(mlp, GATE_UP)
        mlp.forward = types.MethodType(_mlp_forward, mlp)
    log.info(
        "projections fused: q/k/v and gate/up of %d layers, 4 matmuls a layer instead of 7",
        len(model.model.layers),
    )
    return True


def _attention_forward(
    self: Any,
    hidden_states: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
    attention_mask: torch.Tensor | None = None,
    cache: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """transformers' Llama/Mistral/Qwen2 attention forward on the fused projection."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    query, key, value = (
        part.view(hidden_shape).transpose(1, 2)
        for part in self.qkv_proj(hidden_states).split(self.qkv_proj.widths, dim=-1)
    )
    cos, sin = position_embeddings
    query, key = self.rotate(query, key, cos, sin)
    if cache is not None:
        key, value = cache.update(key, value, self.layer_idx, kwargs=kwargs)
    window = sliding_window(self, self.config)
    if window is not None:
        kwargs["sliding_window"] = window
    attend = ALL_ATTENTION_FUNCTIONS.get_interface(
        self.config._attn_implementation,
        sys.modules[type(self).__module__].eager_attention_forward,
    )
    output, weights = attend(
        self, query, key, value, attention_mask, dropout=0.0, scaling=self.scaling, **kwargs
    )
    output = output.reshape(*input_shape, -1).contiguous()
    return self.o_proj(output), weights


def _mlp_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
    return self.down_proj(self.act_fn(gate) * up)

"""Reading a PEFT LoRA folder (adapter_config.json + adapter_model.safetensors) into the
weights services/worker/lora.py stacks: per adapted module, A [r, in] and B [out, r] with the
adapter's scale (alpha / r, alpha / sqrt(r) for rsLoRA, alpha_pattern's per module) folded
into B. PEFT's own config class and weight loader read the files."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from shared.messages import AdapterRef

PEFT_PREFIX = "base_model.model."  # PEFT's tensor names start with it


class AdapterLoadError(ValueError):
    """An adapter this worker cannot load, with the reason for the request that named it."""


@dataclass
class Adapter:
    """One loaded adapter: per module, A [r, in] and B [out, r] with the scale folded in."""

    ref: AdapterRef
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]  # module name -> (A, s * B)
    rank: int  # the largest rank of its modules


def load_adapter(ref: AdapterRef, modules: dict[str, tuple[int, int]], dtype) -> Adapter:
    """Read a PEFT LoRA folder; `modules`: the model's adaptable modules -> (in, out)."""
    from peft import LoraConfig
    from peft.utils import load_peft_weights
    from peft.utils.other import get_pattern_key

    try:
        config = LoraConfig.from_pretrained(ref.path)
        tensors = load_peft_weights(ref.path, device="cpu")
    except Exception as exc:  # missing folder, bad JSON, unreadable safetensors
        raise AdapterLoadError(f"cannot read LoRA adapter {ref.name!r}: {exc}") from exc
    if getattr(config, "use_dora", False):
        raise AdapterLoadError(f"LoRA adapter {ref.name!r} is a DoRA adapter (not supported)")
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        name = key.removeprefix(PEFT_PREFIX)
        for kind in ("lora_A", "lora_B"):
            suffix = f".{kind}.weight"
            if name.endswith(suffix):
                pairs.setdefault(name.removesuffix(suffix), {})[kind] = tensor
                break
        else:
            raise AdapterLoadError(
                f"LoRA adapter {ref.name!r} holds {key}: only lora_A/lora_B weights of linear "
                "layers are supported"
            )
    weights = {}
    for module, pair in pairs.items():
        if module not in modules:
            raise AdapterLoadError(
                f"LoRA adapter {ref.name!r} adapts {module}, which is not a linear layer of "
                "this model (is it an adapter of another base model?)"
            )
        if set(pair) != {"lora_A", "lora_B"}:
            raise AdapterLoadError(f"LoRA adapter {ref.name!r} lacks A or B of {module}")
        a, b = pair["lora_A"], pair["lora_B"]
        rank = a.shape[0]
        if a.shape != (rank, modules[module][0]) or b.shape != (modules[module][1], rank):
            raise AdapterLoadError(
                f"LoRA adapter {ref.name!r}: {module} has A {tuple(a.shape)} and B "
                f"{tuple(b.shape)}, not of this model's ({modules[module][1]} x "
                f"{modules[module][0]}) layer"
            )
        alpha_key = get_pattern_key(list(config.alpha_pattern or {}), module)
        alpha = (config.alpha_pattern or {}).get(alpha_key, config.lora_alpha)
        scale = alpha / math.sqrt(rank) if config.use_rslora else alpha / rank
        weights[module] = (a.to(dtype).contiguous(), (b.float() * scale).to(dtype).contiguous())
    if not weights:
        raise AdapterLoadError(f"LoRA adapter {ref.name!r} holds no LoRA weights")
    return Adapter(ref, weights, max(a.shape[0] for a, _ in weights.values()))

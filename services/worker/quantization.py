"""`--quantize`: TGI's method names mapped to what transformers loads.

- `bitsandbytes` (int8, LLM.int8()), `bitsandbytes-nf4` and `bitsandbytes-fp4` quantize a
  full-precision checkpoint while it loads; bitsandbytes runs on CPU as well as CUDA.
- `gptq` and `awq` name checkpoints quantized ahead of time: their config.json carries the
  `quantization_config` and transformers loads them where their kernels are installed.

Every failure (a missing package, a checkpoint that is not what the flag says) is a
`QuantizationError` with a message that says what to do."""

from __future__ import annotations

from typing import Any

import torch

from shared.settings import QUANTIZE_METHODS

PREQUANTIZED = ("gptq", "awq")


class QuantizationError(RuntimeError):
    """The model cannot be loaded with the requested quantization."""


def quantization_config(method: str | None, config: Any, compute_dtype: torch.dtype) -> Any:
    """The `quantization_config` for from_pretrained (None: leave the checkpoint's own)."""
    if method is None:
        return None
    if method not in QUANTIZE_METHODS:
        raise QuantizationError(
            f"--quantize {method} is unknown; choose one of {', '.join(QUANTIZE_METHODS)}"
        )
    if method in PREQUANTIZED:
        found = getattr(config, "quantization_config", None) or {}
        found = found if isinstance(found, dict) else found.to_dict()
        if found.get("quant_method") != method:
            raise QuantizationError(
                f"--quantize {method} needs a checkpoint quantized with {method.upper()} "
                f"(config.json quantization_config.quant_method), this one has "
                f"{found.get('quant_method') or 'none'}"
            )
        return None
    try:
        import bitsandbytes  # noqa: F401
        from transformers import BitsAndBytesConfig
    except ImportError as exc:
        raise QuantizationError(
            f"--quantize {method} needs bitsandbytes: pip install 'textgen[quantize]'"
        ) from exc
    if method == "bitsandbytes":
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=method.removeprefix("bitsandbytes-"),
        bnb_4bit_compute_dtype=compute_dtype,
    )

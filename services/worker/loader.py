"""Loading a Hugging Face model folder (config.json + safetensors) with transformers' own
modeling code, wired to the paged attention function."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from services.worker import fast_decoder, flash_attention, fused_layers, kernels, paged_attention
from services.worker.kernels import CpuKernels
from services.worker.kv_cache import CacheShape
from services.worker.quantization import QuantizationError, quantization_config
from shared.host import cpu_flags
from shared.model_files import context_length, eos_token_ids, resolve_model_dir

log = logging.getLogger(__name__)

FALLBACK = "fallback"  # LoadedModel.runner of causal LMs services.worker.fallback runs
SEQ2SEQ = "seq2seq"  # LoadedModel.runner of encoder-decoders (services.worker.fallback)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class LoadedModel:
    model: torch.nn.Module
    folder: Path
    cache_shape: CacheShape
    eos_token_ids: list[int]
    max_model_len: int
    device: torch.device
    runner: str = "paged"  # "paged" (attention reads the paged cache), FALLBACK or SEQ2SEQ
    # runs the paged forward pass instead of the model's modules (CPU; its linear weights moved
    # into it): services/worker/fast_decoder.py
    decoder: fast_decoder.FastDecoder | None = None
    # textgen's CPU kernels (the fast decoder's, and greedy sampling's); None off the CPU,
    # with --disable-cpu-kernels, or where they do not build
    kernels: CpuKernels | None = None
    quantize: str | None = None  # --quantize: quantized modules (no CUDA graphs over them)
    world_size: int = 1  # tensor-parallel ranks of the group
    # q/k/v and gate/up each one matmul in transformers' modules (services/worker/fused_layers.py)
    projections_fused: bool = False


def pick_device(name: str | None) -> torch.device:
    if name:
        return torch.device(name)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


# CPU features with native half-precision matmuls (oneDNN uses them); without them half
# precision is emulated and slower than float32
CPU_NATIVE = {torch.bfloat16: {"avx512_bf16", "amx_bf16"}, torch.float16: {"amx_fp16"}}


def pick_dtype(name: str, device: torch.device, config_dtype: torch.dtype | None) -> torch.dtype:
    """`auto`: the checkpoint's dtype; on CPU float32 unless the CPU does that half precision
    natively (bfloat16 with AVX512-BF16 or AMX: about 2.5x float32's matmul speed)."""
    if name != "auto":
        return DTYPES[name]
    if device.type == "cpu":
        native = CPU_NATIVE.get(config_dtype, set()) if config_dtype else set()
        return config_dtype if config_dtype and native & cpu_flags() else torch.float32
    return config_dtype if config_dtype in (torch.float16, torch.bfloat16) else torch.bfloat16


def emulated_half(dtype: torch.dtype, flags: set[str], ops: CpuKernels | None) -> bool:
    """Whether `dtype`'s matmuls run emulated on this CPU: a half precision it has no native
    instructions for (CPU_NATIVE) and none of textgen's kernels take (they widen bfloat16 to
    float32 FMAs on any AVX512 CPU): several times slower than float32 (2 Zen 2 cores, random
    SmolLM2-135M at 32 streams: 14.5 tok/s in bfloat16, 176.9 in float32)."""
    if dtype not in CPU_NATIVE or CPU_NATIVE[dtype] & flags:
        return False
    return not (ops is not None and dtype == torch.bfloat16 and ops.matmul.kind(dtype) != "onednn")


class UnsupportedModel(RuntimeError):
    """The model cannot run on the paged engine (yet)."""


def check_supported(config) -> str:
    """The runner a model needs: "paged" for models whose transformers code dispatches
    attention through AttentionInterface; "fallback" for other causal LMs (ALiBi models such
    as BLOOM and MPT, Falcon), which would silently ignore the paged cache; "seq2seq" for
    encoder-decoders (T5, FLAN-T5). services.worker.fallback runs the last two."""
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

    if getattr(config, "is_encoder_decoder", False):
        if type(config) not in AutoModelForSeq2SeqLM._model_mapping:
            raise UnsupportedModel(f"{config.model_type} is not a text-to-text model")
        return SEQ2SEQ
    try:
        model_class = AutoModelForCausalLM._model_mapping[type(config)]
    except KeyError as exc:
        raise UnsupportedModel(
            f"{config.model_type} is neither a causal language model nor an encoder-decoder "
            "transformers can load"
        ) from exc
    if not getattr(model_class, "_supports_attention_backend", False):
        log.warning(
            "%s does not route attention through transformers' attention interface: it runs "
            "on the fallback runner (each request on its own cache, no prefix caching)",
            getattr(model_class, "__name__", model_class),
        )
        return FALLBACK
    return "paged"


def load_model(
    model_id: str,
    revision: str | None = None,
    dtype: str = "auto",
    device: str | None = None,
    trust_remote_code: bool = False,
    quantize: str | None = None,
    world_size: int = 1,
    cpu_kernels: bool = True,
    fuse_projections: bool = True,
) -> LoadedModel:
    """The model, ready for the paged engine. With world_size > 1 the caller has joined a
    torch.distributed group (services.worker.distributed) and gets this rank's shard. With
    cpu_kernels, a paged model the fast decoder can run on this CPU runs on it; any other
    paged model runs transformers' modules, their projections fused where they can be
    (services/worker/fused_layers.py; `fuse_projections` False keeps them apart, for A/B runs)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM

    paged_attention.register()
    folder = resolve_model_dir(model_id, revision)
    config = AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
    runner = check_supported(config)
    target = pick_device(device)
    config_dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    torch_dtype = pick_dtype(
        dtype, target, config_dtype if isinstance(config_dtype, torch.dtype) else None
    )
    extra: dict[str, Any] = {}
    if world_size > 1:
        from transformers.distributed import DistributedConfig

        if quantize:
            raise QuantizationError("--quantize with --num-shard > 1 is not supported yet")
        text = config.get_text_config()
        if not getattr(text, "base_model_tp_plan", None):
            raise UnsupportedModel(
                f"{config.model_type} has no tensor-parallel plan in transformers: "
                "serve it with --num-shard 1"
            )
        num_kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
        if num_kv_heads % world_size:
            raise UnsupportedModel(
                f"--num-shard {world_size} does not divide the model's {num_kv_heads} "
                "key/value heads"
            )
        extra["distributed_config"] = DistributedConfig(tp_plan="auto")
    if quantize:  # quantized weights are placed while loading and cannot be moved after
        extra["device_map"] = {"": target}
        extra["quantization_config"] = quantization_config(quantize, config, torch_dtype)
        if extra["quantization_config"] is None:
            del extra["quantization_config"]  # gptq/awq: the checkpoint's own
    try:
        auto_class = AutoModelForSeq2SeqLM if runner == SEQ2SEQ else AutoModelForCausalLM
        model = auto_class.from_pretrained(
            folder,
            dtype=torch_dtype,
            attn_implementation=paged_attention.ATTENTION_NAME if runner == "paged" else None,
            trust_remote_code=trust_remote_code,
            **extra,
        )
    except ImportError as exc:  # a quantization backend transformers wants is missing
        raise QuantizationError(
            f"cannot load {model_id} with --quantize {quantize}: {exc}"
        ) from exc
    if not quantize and world_size == 1:  # sharded weights are placed while loading
        model.to(target)  # type: ignore[arg-type]  # transformers' stubs miss the device form
    model.eval()
    text_config = config.get_text_config()
    num_heads = text_config.num_attention_heads
    head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // num_heads
    shape = CacheShape(
        num_layers=text_config.num_hidden_layers,
        # each rank holds its share of the heads (the plan splits them evenly)
        num_kv_heads=(getattr(text_config, "num_key_value_heads", None) or num_heads) // world_size,
        head_dim=head_dim,
        dtype=torch_dtype,
    )
    ops = kernels.load() if cpu_kernels and target.type == "cpu" else None
    if target.type == "cpu" and not quantize and emulated_half(torch_dtype, cpu_flags(), ops):
        log.warning(
            "%s matmuls are emulated on this CPU (no native instructions, no textgen kernel): "
            "several times slower than float32, which --dtype auto serves here",
            str(torch_dtype).removeprefix("torch."),
        )
    decoder = None
    if runner == "paged" and not flash_attention.is_available(target, shape):
        decoder = fast_decoder.build(model, target, quantize, world_size, ops)
    fused = False
    if runner == "paged" and decoder is None and fuse_projections:
        fused = fused_layers.fuse(model, quantize, world_size)
    log.info(
        "loaded %s (%s%s, %s) from %s",
        model_id,
        torch_dtype,
        f", {quantize}" if quantize else "",
        target,
        folder,
    )
    return LoadedModel(
        model=model,
        folder=folder,
        cache_shape=shape,
        eos_token_ids=eos_token_ids(folder),
        max_model_len=context_length(folder),
        device=target,
        runner=runner,
        decoder=decoder,
        kernels=ops,
        quantize=quantize,
        world_size=world_size,
        projections_fused=fused,
    )

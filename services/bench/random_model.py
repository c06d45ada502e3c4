"""Random-weight models shaped like real checkpoints, for benchmarks on machines with no hub
access: `textgen bench --random-model smollm2-135m` builds (once, seeded) a model folder with
the named checkpoint's architecture and sizes and a byte-level BPE tokenizer trained in this
process on the bench's words. Speed depends on the shapes, not on the weights' values.

The model's vocabulary keeps the checkpoint's size (the lm_head matmul costs what it costs
there); the tokenizer only covers its first ids, and ids past them decode to nothing."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from services.bench.workload import WORDS

# config.json fields of the checkpoints benchmarks are shaped after (from their hub configs)
SHAPES: dict[str, dict[str, Any]] = {
    "smollm2-135m": {  # HuggingFaceTB/SmolLM2-135M
        "model_type": "llama",
        "vocab_size": 49152,
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "max_position_embeddings": 8192,
        "rope_theta": 100000.0,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": True,
        "initializer_range": 0.041666666666666664,
    },
    "smollm2-360m": {  # HuggingFaceTB/SmolLM2-360M
        "model_type": "llama",
        "vocab_size": 49152,
        "hidden_size": 960,
        "intermediate_size": 2560,
        "num_hidden_layers": 32,
        "num_attention_heads": 15,
        "num_key_value_heads": 5,
        "max_position_embeddings": 8192,
        "rope_theta": 100000.0,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": True,
        "initializer_range": 0.02,
    },
    # meta-llama/Llama-3.2-1B, its context cut to 8192 positions without the llama3 RoPE
    # scaling (speed depends on the shapes; the scaling changes no matmul)
    "llama-3.2-1b": {
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "max_position_embeddings": 8192,
        "rope_theta": 500000.0,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": True,
        "initializer_range": 0.02,
    },
}
BOS_ID, EOS_ID = 1, 2  # "<s>" and "</s>" in the trained tokenizer


def train_tokenizer(folder: Path, lines: list[str], vocab_size: int) -> int:
    """A byte-level BPE tokenizer trained on `lines`, with `<s>` prepended to every input,
    saved as tokenizer.json; its vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(lines, trainer=trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS_ID)]
    )
    tokenizer.save(str(folder / "tokenizer.json"))
    return tokenizer.get_vocab_size()


def default_cache() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "textgen" / "random-models"


def build_random_model(
    shape: str, cache: Path | None = None, dtype: str = "bfloat16", seed: int = 0
) -> Path:
    """The folder of `shape` with seeded random weights saved as `dtype`, built on first use."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")
    folder = (cache or default_cache()) / f"{shape}-{dtype}-seed{seed}"
    if (folder / "model.safetensors").is_file():
        return folder
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    final, folder = folder, folder.with_name(f"{folder.name}.partial-{os.getpid()}")
    folder.mkdir(parents=True, exist_ok=True)  # renamed into place once complete
    lines = [" ".join(WORDS[i:] + WORDS[:i]) for i in range(len(WORDS))]
    train_tokenizer(folder, lines, vocab_size=1024)
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "model_max_length": SHAPES[shape]["max_position_embeddings"],
            }
        )
    )
    fields = dict(SHAPES[shape])
    config = AutoConfig.for_model(
        fields.pop("model_type"), bos_token_id=BOS_ID, eos_token_id=EOS_ID, **fields
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(getattr(torch, dtype)).eval()
    model.save_pretrained(folder, safe_serialization=True)
    GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID).save_pretrained(folder)
    if final.exists():  # another process built it meanwhile
        shutil.rmtree(folder)
    else:
        folder.rename(final)
    return final

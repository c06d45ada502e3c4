"""Finding a model's files: a local folder, or a hub id resolved through huggingface_hub."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

TOKENIZER_FILES = [
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.json",
    "chat_template.jinja",
]
WEIGHT_FILES = ["*.safetensors", "*.safetensors.index.json", "*.py", "*.model", "*.txt", "*.json"]


class ModelNotFound(RuntimeError):
    """The model folder or hub id cannot be resolved to local files."""


def resolve_model_dir(
    model_id: str, revision: str | None = None, patterns: list[str] | None = None
) -> Path:
    """A local folder with the model's files, downloading from the hub when needed."""
    path = Path(model_id).expanduser()
    if path.is_dir():
        return path.resolve()
    if path.is_absolute() or model_id.startswith("."):
        raise ModelNotFound(f"model folder {model_id} does not exist")
    try:
        from huggingface_hub import snapshot_download

        folder = snapshot_download(
            model_id, revision=revision, allow_patterns=patterns or TOKENIZER_FILES + WEIGHT_FILES
        )
    except Exception as exc:  # offline, unknown repo, gated, ...
        raise ModelNotFound(
            f"cannot get {model_id} from the Hugging Face hub and it is not in the local cache "
            f"({type(exc).__name__}: {first_line(exc)}); pass a local model folder instead "
            "(--model-id /path/to/model, or MODEL_ID=/path/to/model make serve)"
        ) from exc
    return Path(folder)


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (huggingface_hub's run to several)."""
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


def read_json(folder: Path, name: str) -> dict[str, Any]:
    """A JSON file of the model folder, or {} when absent."""
    file = folder / name
    if not file.is_file():
        return {}
    data: dict[str, Any] = json.loads(file.read_text())
    return data


def vocab_size_of(folder: Path) -> int:
    """Rows of the model's logits (its config's vocab_size, padding included)."""
    config = read_json(folder, "config.json")
    return int(config.get("text_config", config).get("vocab_size", 32000))


def eos_token_ids(folder: Path) -> list[int]:
    """End-of-sequence ids from generation_config.json, else config.json."""
    for name in ("generation_config.json", "config.json"):
        value = read_json(folder, name).get("eos_token_id")
        if value is not None:
            return list(value) if isinstance(value, list) else [int(value)]
    return []


def context_length(folder: Path) -> int:
    """The model's context length (max_position_embeddings or an equivalent)."""
    config = read_json(folder, "config.json")
    config = config.get("text_config", config)
    for key in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"):
        if isinstance(config.get(key), int):
            return int(config[key])
    return 4096

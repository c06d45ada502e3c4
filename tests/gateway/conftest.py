"""Gateway test fixtures: a model folder with only what the gateway reads (tokenizer files and
config.json), built in-process with the same trained tokenizer as `tiny_llama` but without
torch, so the gateway suite stays fast."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.tiny_models import train_tokenizer


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("gateway-model")
    vocab_size = train_tokenizer(folder)
    (folder / "config.json").write_text(
        json.dumps(
            {
                "model_type": "llama",
                "vocab_size": vocab_size,
                "max_position_embeddings": 512,
                "bos_token_id": 1,
                "eos_token_id": 2,
            }
        )
    )
    return folder

"""Gateway test fixtures: a model folder with only what the gateway reads (tokenizer files and
config.json), built in-process with the same trained tokenizer as `tiny_llama` but without
torch, so the gateway suite stays fast."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from services.gateway.pipeline.tokenizer import TextTokenizer
from shared.settings import Settings
from tests.gateway.peer import WorkerPeer
from tests.support.gateway_server import serve
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


@pytest.fixture
def settings(redis_url, namespace, tokenizer_dir) -> Settings:
    """Gateway settings with small limits; a test module may override this fixture."""
    return Settings(
        redis_url=redis_url,
        namespace=namespace,
        model_id=str(tokenizer_dir),
        max_total_tokens=64,
        max_input_tokens=32,
    )


@pytest.fixture
def base_url(settings):
    with serve(settings) as url:
        yield url


@pytest.fixture
async def peer(redis_url, namespace, tokenizer_dir):
    """The stand-in worker over real Redis."""
    async with WorkerPeer(redis_url, namespace, TextTokenizer.from_folder(tokenizer_dir)) as p:
        yield p


@pytest.fixture
async def http(base_url):
    async with httpx.AsyncClient(base_url=base_url, timeout=10) as client:
        yield client

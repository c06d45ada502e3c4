"""Session fixtures: a private redis-server, tiny model folders, a fresh namespace per test."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

from tests.support.redis_ha import RedisHA
from tests.support.redis_server import redis_server

STORIES = Path(__file__).resolve().parents[2] / "shared" / "models" / "stories260k"


@pytest.fixture(scope="session")
def redis_url():
    with redis_server() as url:
        yield url


@pytest.fixture
def namespace() -> str:
    return f"t{uuid.uuid4().hex[:10]}"


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    from tests.support.tiny_models import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def stories_model() -> Path:
    if not (STORIES / "model.safetensors").is_file():
        pytest.skip("../shared/models/stories260k is not present")
    return STORIES


def pytest_configure(config):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch

    if not torch.cuda.is_available():
        # Triton kernels run in Triton's interpreter without a GPU (tests/worker/
        # test_triton_attention.py); Triton reads this when first imported, and bitsandbytes
        # imports it early, so it is set before any test module loads
        os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` are skipped where torch sees no CUDA device."""
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items:
        return
    import torch

    if torch.cuda.is_available():
        return
    for item in gpu_items:
        item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))


@pytest.fixture(scope="session")
def tool_caller(tmp_path_factory) -> Path:
    from tests.support.tiny_models import make_tool_caller

    return make_tool_caller(tmp_path_factory.mktemp("tool-caller"))


@pytest.fixture
def redis_ha():
    """A primary, two replicas and three sentinels on loopback (tests/support/redis_ha.py)."""
    ha = RedisHA().start()
    try:
        yield ha
    finally:
        ha.stop()

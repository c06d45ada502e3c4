"""A BLOOM (ALiBi, outside transformers' attention interface) served over HTTP on the fallback
runner: transformers' greedy output alone and in a concurrent batch; /info says which path."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.e2e.conftest import CLUSTER_ARGS
from tests.support.cluster import Cluster
from tests.support.reference import greedy_continuation, tokenizer
from tests.worker.test_architectures import FALLBACK, build

pytestmark = pytest.mark.integration

PROMPTS = ["the cat sat on the mat", "once upon a time there was a girl", "a dog", "hello"]


def test_bloom_serves_transformers_greedy_output(redis_url, namespace, tmp_path):
    folder = build(tmp_path / "bloom", FALLBACK["bloom"])
    cluster = Cluster(redis_url, namespace, folder, args=CLUSTER_ARGS).start()
    try:
        url = cluster.gateway_urls[0]
        from transformers import AutoModelForCausalLM

        reference = AutoModelForCausalLM.from_pretrained(folder).eval()  # eager: BLOOM has no SDPA
        expected = [
            greedy_continuation(reference, tokenizer(folder)(prompt).input_ids, 12, [2])
            for prompt in PROMPTS
        ]

        def generate(prompt: str) -> list[int]:
            body = {"inputs": prompt, "parameters": {"max_new_tokens": 12, "details": True}}
            response = httpx.post(f"{url}/generate", json=body, timeout=60)
            assert response.status_code == 200, response.text
            return [token["id"] for token in response.json()["details"]["tokens"]]

        assert [generate(p) for p in PROMPTS] == expected
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            assert list(pool.map(generate, PROMPTS)) == expected
        assert httpx.get(f"{url}/info", timeout=10).json()["model_runner"] == "fallback"
    finally:
        cluster.stop()

"""Every architecture of the seeds, as a tiny random model, served over HTTP: transformers'
greedy output for each prompt alone and with all prompts in flight together (paged runner for
most, fallback for BLOOM/MPT/Falcon, seq2seq for T5)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from tests.e2e.conftest import CLUSTER_ARGS
from tests.support.cluster import Cluster, generated_ids
from tests.support.reference import tokenizer
from tests.worker.test_architectures import FALLBACK, PAGED, build, build_t5

pytestmark = pytest.mark.integration

PROMPTS = ["the cat sat on the mat", "once upon a time there was a girl", "a dog", "hello"]
RUNNERS = {**dict.fromkeys(PAGED, "paged"), **dict.fromkeys(FALLBACK, "fallback"), "t5": "seq2seq"}


def reference_tokens(folder, runner: str) -> list[list[int]]:
    """transformers' greedy generate (default attention: BLOOM has no SDPA)."""
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

    auto = AutoModelForSeq2SeqLM if runner == "seq2seq" else AutoModelForCausalLM
    model = auto.from_pretrained(folder).eval()
    out = []
    for prompt in PROMPTS:
        ids = tokenizer(folder)(prompt).input_ids
        generated = model.generate(
            torch.tensor([ids]),
            max_new_tokens=12,
            do_sample=False,
            eos_token_id=[2],
            pad_token_id=0,
        )[0].tolist()
        out.append(generated[1:] if runner == "seq2seq" else generated[len(ids) :])
    return out


@pytest.mark.parametrize("name", sorted(RUNNERS))
def test_architecture_serves_transformers_greedy_output(name, redis_url, namespace, tmp_path):
    runner = RUNNERS[name]
    if name == "t5":
        folder = build_t5(tmp_path / name)
    else:
        folder = build(tmp_path / name, {**PAGED, **FALLBACK}[name])
    expected = reference_tokens(folder, runner)
    cluster = Cluster(redis_url, namespace, folder, args=CLUSTER_ARGS).start()
    try:
        url = cluster.gateway_urls[0]

        def generate(prompt: str) -> list[int]:
            return generated_ids(url, prompt, 12)

        assert [generate(p) for p in PROMPTS] == expected
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            assert list(pool.map(generate, PROMPTS)) == expected
        assert httpx.get(f"{url}/info", timeout=10).json()["model_runner"] == runner
    finally:
        cluster.stop()

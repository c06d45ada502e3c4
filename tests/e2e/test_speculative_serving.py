"""A worker group with --speculate 3 serves over HTTP exactly what transformers' greedy
generate gives, alone and in a concurrent batch, and its metrics count proposals."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.support.cluster import generated_ids
from tests.support.reference import greedy_ids

pytestmark = pytest.mark.integration

# repetitive prompts, so proposals are found (and some accepted), and one that is not
PROMPTS = [
    "the cat sat on the mat the cat sat on the mat the cat sat on the",
    "hello world hello world hello world hello",
    "once upon a time there was a girl named lily",
]


def test_speculative_group_serves_transformers_greedy_output(own_cluster, tiny_llama):
    cluster = own_cluster("--speculate", "3", num_groups=1)
    expected = [greedy_ids(tiny_llama, prompt, 24, [2]) for prompt in PROMPTS]

    def generate(prompt: str) -> list[int]:
        return generated_ids(cluster.gateway_urls[0], prompt, 24)

    assert [generate(p) for p in PROMPTS] == expected
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        assert list(pool.map(generate, PROMPTS)) == expected
    # streamed: every token its own event, in order, whatever the step sizes were
    with httpx.stream(
        "POST",
        f"{cluster.gateway_urls[0]}/generate_stream",
        json={"inputs": PROMPTS[0], "parameters": {"max_new_tokens": 24}},
        timeout=60,
    ) as response:
        ids = [int(m) for m in re.findall(r'"token":\{"id":(\d+)', response.read().decode())]
    assert ids == expected[0]
    metrics = httpx.get(
        f"{cluster.ops_urls[f'worker-{cluster.groups[0]}']}/metrics", timeout=10
    ).text
    drafts = float(
        re.search(r"^textgen_worker_speculative_draft_tokens_total (\S+)", metrics, re.M)[1]
    )
    assert drafts > 0

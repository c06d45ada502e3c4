"""End-to-end fixtures: the real services over a real Redis and real HTTP."""

from __future__ import annotations

import pytest

from tests.support.cluster import Cluster

# small budgets so that chunked prefill, joins and block reuse all happen with a tiny model
CLUSTER_ARGS = [
    "--max-batch-prefill-tokens",
    "64",
    "--max-batch-total-tokens",
    "4096",
    "--block-size",
    "16",
    "--max-total-tokens",
    "512",
]


@pytest.fixture(scope="session")
def tiny_cluster(redis_url, tiny_llama):
    """Two gateways and two worker groups on one Redis, serving the tiny random Llama."""
    cluster = Cluster(
        redis_url, "e2e-tiny", tiny_llama, num_groups=2, num_gateways=2, args=CLUSTER_ARGS
    )
    try:
        yield cluster.start()
    finally:
        cluster.stop()


@pytest.fixture
def own_cluster(redis_url, tiny_llama, namespace):
    """A factory of clusters for tests that break them (kill, stop): each test gets its own,
    stopped at the end."""
    clusters: list[Cluster] = []

    def start(*flags: str, num_groups: int = 2, num_gateways: int = 1) -> Cluster:
        cluster = Cluster(
            redis_url,
            f"{namespace}{len(clusters)}",
            tiny_llama,
            num_groups=num_groups,
            num_gateways=num_gateways,
            args=[*CLUSTER_ARGS, *flags],
        )
        clusters.append(cluster)
        return cluster.start()

    yield start
    for cluster in clusters:
        cluster.stop()


@pytest.fixture(scope="session")
def stories_cluster(redis_url, stories_model):
    """One gateway and one worker group serving the real stories260k model."""
    cluster = Cluster(redis_url, "e2e-stories", stories_model, args=CLUSTER_ARGS)
    try:
        yield cluster.start()
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def tool_cluster(redis_url, tool_caller):
    """One gateway and one worker group serving the rigged tool-calling model."""
    args = [*CLUSTER_ARGS, "--max-total-tokens", "2048"]  # tools in the prompt: long prompts
    cluster = Cluster(redis_url, "e2e-tools", tool_caller, args=args)
    try:
        yield cluster.start()
    finally:
        cluster.stop()


@pytest.fixture
def online(monkeypatch):
    """The suite runs with HF_HUB_OFFLINE=1, which also blocks InferenceClient's HTTP calls."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)

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


@pytest.fixture(scope="session")
def stories_cluster(redis_url, stories_model):
    """One gateway and one worker group serving the real stories260k model."""
    cluster = Cluster(redis_url, "e2e-stories", stories_model, args=CLUSTER_ARGS)
    try:
        yield cluster.start()
    finally:
        cluster.stop()

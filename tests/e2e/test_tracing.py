"""One trace per request across processes: gateway -> queue -> scheduler -> worker, exported
with OTLP over HTTP to a loopback receiver."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.e2e.conftest import CLUSTER_ARGS
from tests.support.cluster import Cluster
from tests.support.otlp_receiver import OtlpReceiver

pytestmark = pytest.mark.integration


def test_one_trace_spans_gateway_scheduler_and_worker(redis_url, tiny_llama):
    with OtlpReceiver() as receiver:
        cluster = Cluster(
            redis_url,
            "e2e-trace",
            tiny_llama,
            args=[*CLUSTER_ARGS, "--otlp-endpoint", receiver.url],
        )
        try:
            url = cluster.start().gateway_urls[0]
            response = httpx.post(
                f"{url}/generate",
                timeout=60,
                json={"inputs": "the cat sat", "parameters": {"max_new_tokens": 5}},
            )
            assert response.status_code == 200
            deadline = time.monotonic() + 20
            wanted = {"textgen-gateway", "textgen-scheduler", "textgen-worker"}
            while time.monotonic() < deadline:
                roots = [s for s in receiver.spans if s.name == "gateway.generate"]
                if roots and wanted <= {
                    s.service for s in receiver.spans if s.trace_id == roots[0].trace_id
                }:
                    break
                time.sleep(0.2)
        finally:
            cluster.stop()
    (generate,) = [s for s in receiver.spans if s.name == "gateway.generate"]
    trace = {s.name: s for s in receiver.spans if s.trace_id == generate.trace_id}
    by_id = {s.span_id: s for s in trace.values()}
    # FastAPI's own server span is the root; ours hangs below it, the others below ours
    root = trace["POST /generate"]
    assert root.parent_span_id == ""
    ancestor = generate
    while ancestor.parent_span_id:
        ancestor = by_id[ancestor.parent_span_id]
    assert ancestor is root
    assert {"scheduler.queue_wait", "scheduler.request", "worker.generate"} <= set(trace)
    assert trace["scheduler.request"].service == "textgen-scheduler"
    assert trace["worker.generate"].service == "textgen-worker"
    for name in ("scheduler.queue_wait", "scheduler.request", "worker.generate"):
        assert trace[name].parent_span_id == generate.span_id, name
    assert trace["worker.generate"].attributes["num_generated_tokens"] == 5
    request_ids = {s.attributes.get("request_id") for s in trace.values()} - {None}
    assert len(request_ids) == 1

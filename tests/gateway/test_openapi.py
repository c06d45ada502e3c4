"""/openapi.json documents every route with the request models that really decode it."""

from __future__ import annotations

import httpx
import pytest

from services.gateway.app import create_app
from services.gateway.openapi.routes import OPERATIONS
from shared.settings import Settings


@pytest.fixture(scope="module")
def app(tokenizer_dir):
    return create_app(Settings(model_id=str(tokenizer_dir), redis_url="redis://127.0.0.1:1"))


def refs(node) -> list[str]:
    if isinstance(node, dict):
        found = [node["$ref"]] if "$ref" in node else []
        return found + [r for value in node.values() for r in refs(value)]
    if isinstance(node, list):
        return [r for value in node for r in refs(value)]
    return []


async def test_document_describes_bodies_and_every_reference_resolves(app):
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
        document = (await client.get("/openapi.json")).json()
        docs = await client.get("/docs")
    assert docs.status_code == 200 and "swagger" in docs.text.lower()
    schemas = document["components"]["schemas"]
    for (method, path), described in OPERATIONS.items():
        operation = document["paths"][path][method]
        assert operation["summary"] and "200" in operation["responses"]
        if described.body is None:
            assert "requestBody" not in operation
            continue
        body = operation["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": f"#/components/schemas/{described.body.__name__}"}
    # every route is documented, GET / included; the probes answer 200 with no body
    assert {("get", "/"), ("get", "/health"), ("get", "/live")} <= set(OPERATIONS)
    assert "content" not in document["paths"]["/live"]["get"]["responses"]["200"]
    assert "application/json" in document["paths"]["/health"]["get"]["responses"]["503"]["content"]
    # body rejections are documented as the plain text they are; the OpenAI routes' as JSON
    generate = document["paths"]["/generate"]["post"]["responses"]
    assert set(generate["415"]["content"]) == {"text/plain"}
    assert set(generate["422"]["content"]) == {"text/plain", "application/json"}
    chat = document["paths"]["/v1/chat/completions"]["post"]["responses"]
    assert set(chat["415"]["content"]) == {"application/json"} and "422" not in chat
    assert set(chat["200"]["content"]) == {"application/json", "text/event-stream"}
    generate = schemas["GenerateParameters"]["properties"]
    for field in ("max_new_tokens", "top_n_tokens", "decoder_input_details", "watermark", "stop"):
        assert field in generate, field
    for ref in refs(document):
        assert ref.startswith("#/components/schemas/")
        assert ref.removeprefix("#/components/schemas/") in schemas, ref

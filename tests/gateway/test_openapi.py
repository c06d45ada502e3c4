"""/openapi.json documents every route with the request models that really decode it."""

from __future__ import annotations

import httpx
import pytest

from services.gateway.app import create_app
from services.gateway.openapi_routes import BODIES
from shared.settings import Settings


@pytest.fixture(scope="module")
def app(stories_model):
    return create_app(Settings(model_id=str(stories_model), redis_url="redis://127.0.0.1:1"))


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
    for (method, path), model in BODIES.items():
        operation = document["paths"][path][method]
        body = operation["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": f"#/components/schemas/{model.__name__}"}
        assert operation["summary"]
        assert {"200", "422"} <= set(operation["responses"])
    generate = schemas["GenerateParameters"]["properties"]
    for field in ("max_new_tokens", "top_n_tokens", "decoder_input_details", "watermark", "stop"):
        assert field in generate, field
    for ref in refs(document):
        assert ref.startswith("#/components/schemas/")
        assert ref.removeprefix("#/components/schemas/") in schemas, ref

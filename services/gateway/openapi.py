"""The OpenAPI document (/openapi.json, shown at /docs).

The routes read their raw body themselves (to answer body errors exactly as TGI does), so
FastAPI cannot see the request models; `describe()` adds each route's request body schema
(from the same pydantic models that decode it) and its main responses to the generated
document."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel

Route = tuple[str, str]  # (method, path), e.g. ("post", "/generate")

ERROR_SCHEMA = {
    "type": "object",
    "properties": {"error": {"type": "string"}, "error_type": {"type": "string"}},
    "required": ["error", "error_type"],
}


def describe(
    app: FastAPI,
    bodies: dict[Route, type[BaseModel]],
    summaries: dict[Route, str],
    streams: set[Route],
) -> None:
    """Install an `app.openapi` that documents request bodies, errors and SSE answers."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        from fastapi.openapi.utils import get_openapi

        document = get_openapi(title=app.title, version=app.version, routes=app.routes)
        schemas = document.setdefault("components", {}).setdefault("schemas", {})
        schemas["ErrorResponse"] = ERROR_SCHEMA
        for (method, path), model in bodies.items():
            operation = document["paths"].get(path, {}).get(method)
            if operation is None:
                continue
            schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
            schemas.update(schema.pop("$defs", {}))
            schemas[model.__name__] = schema
            operation["requestBody"] = {
                "required": True,
                "content": {
                    "application/json": {
                        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}
                    }
                },
            }
            operation["responses"] = _responses((method, path) in streams)
        for route, summary in summaries.items():
            operation = document["paths"].get(route[1], {}).get(route[0])
            if operation is not None:
                operation["summary"] = summary
        app.openapi_schema = document
        return document

    app.openapi = openapi  # type: ignore[method-assign]


def _responses(is_stream: bool) -> dict[str, Any]:
    error = {
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}
    }
    ok: dict[str, Any] = (
        {
            "description": "Server-sent events, one `data: {json}` per token; errors in-band",
            "content": {"text/event-stream": {"schema": {"type": "string"}}},
        }
        if is_stream
        else {"description": "Generated text", "content": {"application/json": {}}}
    )
    responses: dict[str, Any] = {
        "200": ok,
        "400": {"description": "Malformed JSON body (text/plain)"},
        "401": {"description": "Missing or wrong API key"},
        "413": {"description": "Body larger than --payload-limit"},
        "415": {"description": "Content-Type is not application/json"},
        "422": {"description": "Input validation error", **error},
    }
    if not is_stream:
        responses["424"] = {"description": "Generation failed on the worker", **error}
        responses["429"] = {"description": "Model is overloaded", **error}
        responses["503"] = {"description": "Redis or the workers are unreachable", **error}
    return responses

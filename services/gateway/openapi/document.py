"""The OpenAPI document (/openapi.json, shown at /docs), describing what the server does.

The routes read their raw body themselves (to answer body errors exactly as TGI does), so
FastAPI sees neither their request models nor their answers; `describe()` writes both into
the generated document from a table of `Operation`s (openapi/routes.py): each route's request
body (the pydantic model that decodes it), and every status it answers with the content type
and shape of that answer (openapi/models.py). Server-sent events are documented as
`text/event-stream`, one event per schema, the JSON of its `data:` line as a contentSchema.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel

Route = tuple[str, str]  # (method, path), e.g. ("post", "/generate")
Content = dict[str, Any]  # media type -> media type object


def ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def json_of(*models: type[BaseModel]) -> Content:
    """application/json whose body is one of `models`."""
    schema = ref(models[0]) if len(models) == 1 else {"oneOf": [ref(m) for m in models]}
    return {"application/json": {"schema": schema}}


def sse_of(*models: type[BaseModel], has_done: bool = True) -> Content:
    """text/event-stream: each event's `data` is JSON of one of `models`, or `[DONE]` (the
    OpenAI streams' last). Open API 3.1 reads `schema` as one event's; the JSON of its data is
    a `contentSchema`."""
    json_data = {
        "contentMediaType": "application/json",
        "contentSchema": {"anyOf": [ref(m) for m in models]},
    }
    data = {
        "type": "string",
        **({"if": {"const": "[DONE]"}, "else": json_data} if has_done else json_data),
    }
    event = {"type": "object", "required": ["data"], "properties": {"data": data}}
    return {"text/event-stream": {"schema": event}}


TEXT: Content = {"text/plain": {"schema": {"type": "string"}}}


def answer(description: str, *contents: Content) -> dict[str, Any]:
    """A response object: no content when none is given (an empty body)."""
    merged: Content = {}
    for content in contents:
        merged.update(content)
    return (
        {"description": description, "content": merged} if merged else {"description": description}
    )


@dataclass(frozen=True)
class Operation:
    """One route as the document describes it."""

    summary: str
    responses: dict[str, dict[str, Any]]  # status -> response object (answer())
    body: type[BaseModel] | None = None  # the request body's model


def referenced(node: Any) -> set[str]:
    """Names of the component schemas a part of the document refers to."""
    if isinstance(node, dict):
        found = {node["$ref"].rsplit("/", 1)[1]} if "$ref" in node else set()
        return found.union(*(referenced(value) for value in node.values()))
    if isinstance(node, list):
        return set().union(*(referenced(value) for value in node))
    return set()


def describe(
    app: FastAPI, operations: dict[Route, Operation], known: dict[str, type[BaseModel]]
) -> None:
    """Install an `app.openapi` that writes `operations` into the generated document; `known`
    names the models their answers refer to."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        from fastapi.openapi.utils import get_openapi

        document = get_openapi(title=app.title, version=app.version, routes=app.routes)
        schemas = document.setdefault("components", {}).setdefault("schemas", {})
        for (method, path), operation in operations.items():
            target = document["paths"].get(path, {}).get(method)
            if target is None:
                continue
            names = referenced(operation.responses)
            models = [known[name] for name in sorted(names)]
            for model in [*models, *([operation.body] if operation.body else [])]:
                schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
                schemas.update(schema.pop("$defs", {}))
                schemas[model.__name__] = schema
            if operation.body is not None:
                target["requestBody"] = {"required": True, "content": json_of(operation.body)}
            target["summary"] = operation.summary
            target["responses"] = operation.responses
        app.openapi_schema = document
        return document

    app.openapi = openapi  # type: ignore[method-assign]

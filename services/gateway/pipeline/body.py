"""Reading a JSON request body the way TGI's axum `Json` extractor does.

The raw body is read here (not by FastAPI) so that every rejection has TGI's status and
plain-text message: 415 wrong Content-Type, 413 too large, 400 not JSON, 422 wrong shape.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, TypeVar

import pydantic
from fastapi import Request

from services.gateway.pipeline.errors import BodyError

T = TypeVar("T", bound=pydantic.BaseModel)

CONTENT_TYPE_TEXT = "Expected request with `Content-Type: application/json`"
TOO_LARGE_TEXT = "Failed to buffer the request body: length limit exceeded"
LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number out of range: {text[:40]}")
    return value


def _check_strings(value: Any) -> None:
    """Reject lone UTF-16 surrogates ("\\ud800"), as serde_json does: no valid text has them."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if LONE_SURROGATE.search(item):
                raise ValueError("lone surrogate in a string escape")
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


def loads_strict(raw: bytes) -> Any:
    """JSON as serde_json reads it: UTF-8 only (no BOM), no NaN/Infinity, no out-of-range floats, no
    lone surrogates; raises ValueError (RecursionError for absurd nesting is one too)."""
    try:
        # UTF-8 only: json.loads(bytes) would also take UTF-16/32 and a BOM, serde_json does not
        text = raw.decode("utf-8")
        data = json.loads(text, parse_constant=_no_constant, parse_float=_finite_float)
    except RecursionError as exc:
        raise ValueError("recursion limit exceeded") from exc
    _check_strings(data)
    return data


def is_json_content_type(value: str | None) -> bool:
    """`application/json` or any `application/*+json`, parameters (charset) allowed."""
    if not value:
        return False
    mime = value.split(";", 1)[0].strip().lower()
    if not mime.startswith("application/"):
        return False
    subtype = mime[len("application/") :]
    return subtype == "json" or subtype.endswith("+json")


async def read_body(request: Request, payload_limit: int) -> bytes:
    """The raw body, refusing (413) as soon as it grows past `payload_limit` bytes. Kept on
    the request (request.state.raw_body) so a route that sniffs the body can hand the request
    to another route, which reads it again."""
    cached = getattr(request.state, "raw_body", None)
    if cached is not None:
        return cached
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > payload_limit:
        raise BodyError(413, TOO_LARGE_TEXT)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > payload_limit:
            raise BodyError(413, TOO_LARGE_TEXT)
        chunks.append(chunk)
    request.state.raw_body = b"".join(chunks)
    return request.state.raw_body


def describe_errors(exc: pydantic.ValidationError) -> str:
    """A one-line serde-like description of the first shape error."""
    first = exc.errors()[0]
    location = ".".join(str(part) for part in first["loc"])
    prefix = f"{location}: " if location else ""
    return f"{prefix}{first['msg']} (got {json.dumps(first.get('input'), default=str)[:80]})"


def top_field(exc: pydantic.ValidationError) -> str | None:
    """The body field the first shape error is in (None for the body itself)."""
    location = exc.errors()[0]["loc"]
    return str(location[0]) if location else None


def parse_body(raw: bytes, content_type: str | None, model: type[T]) -> T:
    """Decode a body already read; raise BodyError with TGI's status and text."""
    if not is_json_content_type(content_type):
        raise BodyError(415, CONTENT_TYPE_TEXT)
    try:
        data = loads_strict(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BodyError(400, f"Failed to parse the request body as JSON: {exc}") from exc
    try:
        return model.model_validate(data)
    except pydantic.ValidationError as exc:
        raise BodyError(
            422,
            f"Failed to deserialize the JSON body into the target type: {describe_errors(exc)}",
            param=top_field(exc),
        ) from exc


async def read_json(request: Request, model: type[T], payload_limit: int) -> T:
    """Read and decode the request body into `model` (raises BodyError)."""
    if not is_json_content_type(request.headers.get("content-type")):
        raise BodyError(415, CONTENT_TYPE_TEXT)
    raw = await read_body(request, payload_limit)
    return parse_body(raw, request.headers.get("content-type"), model)

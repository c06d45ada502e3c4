"""Errors of the OpenAI routes, in OpenAI's shape (pure).

Every error the OpenAI routes answer, before or inside a stream, is
`{"error": {"message", "type", "param", "code"}}`, as OpenAI's API reference and vLLM give it:
the same `GatewayError`s and `BodyError`s the TGI routes answer in TGI's shape, with

- the status: a request the server will not run is 400 (TGI says 422; OpenAI and vLLM say
  400), 401/404/413/415/429 and the 5xx keep theirs, a generation that failed on a worker is 500
  (TGI's 424 is no OpenAI status);
- `type`: OpenAI's class of the status (invalid_request_error, authentication_error,
  not_found_error, rate_limit_error, server_error);
- `param`: the request field at fault, in the OpenAI request's own names, or null;
- `code`: textgen's machine tag of the cause (validation, overloaded, generation,
  template_error, ...), a string as OpenAI's `code` is.
"""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

from services.gateway.pipeline.errors import BodyError, GatewayError

OPENAI_STATUS = {422: 400, 424: 500}  # TGI's statuses that OpenAI's API does not use
ERROR_TYPES = {
    401: "authentication_error",
    404: "not_found_error",
    429: "rate_limit_error",
}
BODY_CODES = {400: "invalid_json", 413: "payload_too_large", 415: "unsupported_media_type"}
# TGI's parameter names -> the fields of each OpenAI request they come from
CHAT_FIELDS = {"inputs": "messages", "max_new_tokens": "max_tokens", "top_n_tokens": "top_logprobs"}
COMPLETION_FIELDS = {"inputs": "prompt", "max_new_tokens": "max_tokens", "top_n_tokens": "logprobs"}


def error_type(status: int) -> str:
    if status in ERROR_TYPES:
        return ERROR_TYPES[status]
    return "server_error" if status >= 500 else "invalid_request_error"


def error_object(message: str, status: int, code: str, param: str | None) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type(status), "param": param, "code": code}}


def openai_status(exc: GatewayError) -> int:
    return OPENAI_STATUS.get(exc.status, exc.status)


def gateway_error_body(exc: GatewayError, fields: dict[str, str]) -> dict[str, Any]:
    """The error object of a GatewayError, its `param` in the request's own names (`fields`:
    CHAT_FIELDS or COMPLETION_FIELDS); also the payload of an in-stream error event."""
    param = fields.get(exc.param, exc.param) if exc.param else None
    return error_object(exc.message, openai_status(exc), exc.error_type, param)


def gateway_error_response(exc: GatewayError, fields: dict[str, str]) -> JSONResponse:
    return JSONResponse(gateway_error_body(exc, fields), status_code=openai_status(exc))


def body_error_response(exc: BodyError) -> JSONResponse:
    """A body the route could not decode: 415, 413, 400 (not JSON), 400 (wrong shape)."""
    status = 400 if exc.status == 422 else exc.status
    code = BODY_CODES.get(exc.status, "invalid_request")
    return JSONResponse(error_object(exc.text, status, code, exc.param), status_code=status)


def unauthorized_response() -> JSONResponse:
    """401 for a missing or wrong key, as OpenAI answers it."""
    body = error_object("Incorrect API key provided", 401, "invalid_api_key", None)
    return JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})

"""Errors the gateway answers with, in TGI's shapes.

Two families: `GatewayError` is TGI's JSON error (`{"error", "error_type"}`), used by every
route and also sent as an in-stream SSE event; `BodyError` is a framework-level body rejection
(415/400/422/413) whose body is plain text, exactly as TGI's axum extractors answer. The
OpenAI routes answer both in OpenAI's shape instead (openai/errors.py).
"""

from __future__ import annotations

from fastapi.responses import JSONResponse, PlainTextResponse, Response


class GatewayError(Exception):
    """A TGI-shaped error: HTTP status, human message and machine `error_type`."""

    def __init__(
        self,
        status: int,
        message: str,
        error_type: str,
        metric_label: str = "",
        param: str | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.error_type = error_type
        # label of tgi_request_failure{err=...}; TGI's labels differ from error_type for some
        self.metric_label = metric_label or error_type
        self.param = param  # the request field at fault (TGI's name), when one is

    def body(self) -> dict[str, str]:
        return {"error": self.message, "error_type": self.error_type}

    def response(self, headers: dict[str, str] | None = None) -> Response:
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


class ValidationError(GatewayError):
    """422 `Input validation error: ...`."""

    def __init__(self, text: str, param: str | None = None):
        super().__init__(422, f"Input validation error: {text}", "validation", param=param)


def overloaded() -> GatewayError:
    return GatewayError(429, "Model is overloaded", "overloaded")


def generation_failed(detail: str, error_type: str = "") -> GatewayError:
    """A worker's error for the request; "validation" (its grammar failed on the worker) is
    the client's, a 422 like every validation error."""
    if error_type == "validation":
        return ValidationError(detail)
    return GatewayError(
        424,
        f"Request failed during generation: {detail}",
        error_type or "generation",
        metric_label="generation",
    )


def incomplete_generation() -> GatewayError:
    """A generation that ended without its final token (a non-stream answer)."""
    return GatewayError(500, "Incomplete generation", "incomplete_generation", "incomplete")


def unavailable(detail: str) -> GatewayError:
    return GatewayError(503, f"Service unavailable: {detail}", "unavailable")


def unhealthy() -> GatewayError:
    return GatewayError(503, "unhealthy", "healthcheck")


class BodyError(Exception):
    """A request body the framework rejects before any handler logic: plain-text answer."""

    def __init__(self, status: int, text: str, param: str | None = None):
        super().__init__(text)
        self.status = status
        self.text = text
        self.param = param  # the field at fault (dotted path), for a shape error

    def response(self) -> Response:
        return PlainTextResponse(self.text, status_code=self.status)

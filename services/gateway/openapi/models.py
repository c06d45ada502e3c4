"""The shapes of the gateway's answers, as pydantic models for /openapi.json only.

The routes build their JSON as plain dicts (tgi/formatting.py, openai/format.py); these models
describe those dicts so that clients and schema-driven tests can hold the server to them
(tests/e2e/test_fuzz.py checks every answer of a fuzzing run against this document).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, RootModel

# --- TGI ---------------------------------------------------------------------------------


class ErrorResponse(BaseModel):
    """TGI's error body; also the one SSE event of a stream that fails."""

    error: str
    error_type: str


class TokenOut(BaseModel):
    id: int
    text: str
    logprob: float | None
    special: bool


class PrefillToken(BaseModel):
    id: int
    text: str
    logprob: float | None


FinishReasonOut = Literal["length", "eos_token", "stop_sequence"]


class SequenceDetails(BaseModel):
    finish_reason: FinishReasonOut
    generated_tokens: int
    seed: int | None
    prefill: list[PrefillToken]
    tokens: list[TokenOut]
    top_tokens: list[list[TokenOut]] | None = None  # with top_n_tokens


class BestOfSequence(SequenceDetails):
    generated_text: str


class Details(SequenceDetails):
    best_of_sequences: list[BestOfSequence] | None = None  # with best_of > 1


class GenerateResponse(BaseModel):
    generated_text: str
    details: Details | None = None  # present when `details` or `decoder_input_details`


class CompatResponse(RootModel[list[GenerateResponse]]):
    """POST / without `stream`: a one-element array."""


class StreamDetails(BaseModel):
    finish_reason: FinishReasonOut
    generated_tokens: int
    seed: int | None
    input_length: int


class StreamResponse(BaseModel):
    """One SSE event of /generate_stream: a token; the last one has the text and details."""

    index: int
    token: TokenOut
    top_tokens: list[TokenOut] | None = None
    generated_text: str | None
    details: StreamDetails | None


class TokenSpan(BaseModel):
    id: int
    text: str
    start: int  # byte offset into the input
    stop: int


class TokenizeResponse(RootModel[list[TokenSpan]]):
    """POST /tokenize."""


class ChatTokenizeResponse(BaseModel):
    tokenize_response: list[TokenSpan]
    templated_text: str


class VertexResponse(BaseModel):
    predictions: list[str]


class Info(BaseModel):
    """GET /info (TGI 3.x fields, 2.x fields still read by dashboards, textgen's own)."""

    model_config = ConfigDict(extra="allow")

    model_id: str
    model_sha: str | None
    model_pipeline_tag: str | None
    max_concurrent_requests: int
    max_best_of: int
    max_stop_sequences: int
    max_input_tokens: int
    max_total_tokens: int
    validation_workers: int
    max_client_batch_size: int
    router: str
    version: str


# --- OpenAI --------------------------------------------------------------------------------


class OpenAIErrorDetail(BaseModel):
    message: str
    type: str  # invalid_request_error, authentication_error, rate_limit_error, server_error...
    param: str | None  # the request field at fault
    code: str | None  # textgen's tag of the cause: validation, overloaded, generation, ...


class OpenAIError(BaseModel):
    """OpenAI's error body; also the SSE event of a stream that fails after it started."""

    error: OpenAIErrorDetail


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCallOut(BaseModel):
    id: str  # chatcmpl-tool-…
    type: Literal["function"]
    function: FunctionCall


class ChatMessageOut(BaseModel):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[ToolCallOut] | None = None  # present when the answer calls tools


class FunctionCallDelta(BaseModel):
    name: str | None = None  # on a call's first delta
    arguments: str | None = None  # a piece of the JSON text; pieces concatenate per index


class ToolCallDelta(BaseModel):
    index: int  # which call of the message
    id: str | None = None  # on a call's first delta
    type: Literal["function"] | None = None
    function: FunctionCallDelta


OpenAIFinishReason = Literal["stop", "length", "tool_calls"]


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None
    finish_reason: OpenAIFinishReason


class ChatCompletion(BaseModel):
    id: str  # chatcmpl-…
    object: Literal["chat.completion"]
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: OpenAIFinishReason | None


class ChatCompletionChunk(BaseModel):
    """One SSE event of a streamed chat answer (the usage chunk has no choices)."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None  # only with stream_options.include_usage


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: OpenAIFinishReason | None  # null in a stream's chunks before the last


class Completion(BaseModel):
    """POST /v1/completions, and (with null finish_reason, no usage) each streamed chunk."""

    id: str  # cmpl-…
    object: Literal["text_completion"]
    created: int
    model: str
    system_fingerprint: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class Model(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str | None = None  # a LoRA adapter's folder
    parent: str | None = None  # a LoRA adapter's base model


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[Model]

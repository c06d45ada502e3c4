"""Request bodies of the OpenAI-compatible routes (/v1/chat/completions, /v1/completions), as
pydantic models that reject what TGI's serde rejects (reference §9.1, §10).

Only the shape is checked here (a wrong shape is a 400 from pipeline/body.py, in OpenAI's
error shape); value rules are in openai/params.py and TGI's validation, applied after the
mapping. Unknown fields are ignored.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from services.gateway.tgi.schemas import UInt32, UInt64

STRICT = ConfigDict(strict=True, extra="ignore")


class ImageUrl(BaseModel):
    model_config = STRICT

    url: str


class ContentChunk(BaseModel):
    """One part of a message's content: text, or an image that becomes inline markdown."""

    model_config = STRICT

    type: Literal["text", "image_url"]
    text: str | None = None
    image_url: ImageUrl | None = None

    @model_validator(mode="after")
    def _has_payload(self) -> ContentChunk:
        if self.type == "text" and self.text is None:
            raise ValueError("a text chunk needs `text`")
        if self.type == "image_url" and self.image_url is None:
            raise ValueError("an image_url chunk needs `image_url`")
        return self

    def as_text(self) -> str:
        if self.type == "text":
            return self.text or ""
        return f"![]({self.image_url.url})" if self.image_url else ""


class Message(BaseModel):
    model_config = STRICT

    role: str
    content: str | list[ContentChunk] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _has_content_or_tool_calls(self) -> Message:
        if self.content is None and self.tool_calls is None:
            raise ValueError("a message needs `content` or `tool_calls`")
        return self

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(chunk.as_text() for chunk in self.content)
        return self.content or ""

    def for_template(self) -> dict[str, Any]:
        """The message as the chat template sees it: content flattened to one string."""
        message: dict[str, Any] = {"role": self.role, "content": self.text()}
        for key in ("name", "tool_calls", "tool_call_id"):
            value = getattr(self, key)
            if value is not None:
                message[key] = value
        return message


class StreamOptions(BaseModel):
    model_config = STRICT

    include_usage: bool = False  # one last chunk with the usage and no choices


# OpenAI's map of token ids (as JSON object keys) to biases in [-100, 100]; TGI typed it as a
# list of floats, which is accepted when empty and refused otherwise (openai/params.py)
LogitBias = dict[str, float] | list[float]


class StructuredOutputs(BaseModel):
    """The constraint fields both OpenAI routes take beyond OpenAI's `response_format`: vLLM's
    `structured_outputs` object and its legacy top-level `guided_*` fields."""

    model_config = STRICT

    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    ignore_eos: bool = False  # vLLM's: generate until max_tokens whatever the model says

    def guided(self) -> dict[str, Any]:
        return {
            "guided_json": self.guided_json,
            "guided_regex": self.guided_regex,
            "guided_choice": self.guided_choice,
            "guided_grammar": self.guided_grammar,
            "guided_whitespace_pattern": self.guided_whitespace_pattern,
        }


def _reject_null(value: Any) -> Any:
    if value is None:
        raise ValueError("null is not accepted here")
    return value


class ChatBody(StructuredOutputs):
    """Body of POST /v1/chat/completions."""

    model: str | None = None
    messages: list[Message]
    max_tokens: UInt32 | None = None
    max_completion_tokens: UInt32 | None = None
    temperature: float | None = None
    top_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    seed: UInt64 | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: bool | None = None
    top_logprobs: UInt32 | None = None
    n: UInt32 | None = None
    logit_bias: LogitBias | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    tool_prompt: str | None = None  # TGI's: appended when the template does not show tools
    parallel_tool_calls: bool | None = None  # False: at most one call
    user: str | None = None

    _no_null_stream_options = field_validator("stream_options", mode="before")(_reject_null)


class CompletionBody(StructuredOutputs):
    """Body of POST /v1/completions."""

    model: str | None = None
    prompt: str | Annotated[list[str], Field(min_length=1)]
    max_tokens: UInt32 | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: UInt64 | None = None
    stop: str | list[str] | None = None
    repetition_penalty: float | None = None  # TGI's extension, its native meaning
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    suffix: str | None = None
    n: UInt32 | None = None  # completions per prompt
    best_of: UInt32 | None = None  # candidates per prompt, of which the n best are returned
    logprobs: UInt32 | None = None  # the chosen token's logprob and this many alternatives
    echo: bool = False  # the prompt leads each completion's text
    logit_bias: LogitBias | None = None
    user: str | None = None

    _no_null_stream_options = field_validator("stream_options", mode="before")(_reject_null)

    @property
    def prompts(self) -> list[str]:
        return [self.prompt] if isinstance(self.prompt, str) else list(self.prompt)

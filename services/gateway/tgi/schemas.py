"""Request bodies of the TGI routes, as pydantic models that reject what TGI's serde rejects.

Strict types (no "1" for 1, no null where TGI has a non-optional field, no negative uints);
unknown fields are ignored. Only the shape is checked here; value rules live in validation.py.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

UInt32 = Annotated[int, Field(ge=0, le=2**32 - 1)]
UInt64 = Annotated[int, Field(ge=0, le=2**64 - 1)]
Int32 = Annotated[int, Field(ge=-(2**31), le=2**31 - 1)]


class GenerateParameters(BaseModel):
    """TGI's `parameters` object (every field optional; see the defaults quirk in GenerateBody)."""

    model_config = ConfigDict(strict=True, extra="ignore")

    best_of: UInt64 | None = None
    temperature: float | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    top_k: Int32 | None = None
    top_p: float | None = None
    typical_p: float | None = None
    do_sample: bool = False
    max_new_tokens: UInt32 | None = None
    return_full_text: bool | None = None
    stop: list[str] = []
    truncate: UInt64 | None = None
    watermark: bool = False
    details: bool = False
    decoder_input_details: bool = False
    seed: UInt64 | None = None
    top_n_tokens: UInt32 | None = None
    grammar: dict[str, Any] | None = None
    adapter_id: str | None = None
    priority: Int32 | None = None  # textgen extension: > 0 high lane, < 0 low lane (FCFS in each)


def sampling_preset() -> GenerateParameters:
    """What TGI uses when `parameters` is absent: the type defaults, but sampling on (quirk)."""
    return GenerateParameters(do_sample=True)


class GenerateBody(BaseModel):
    """Body of POST /generate and /generate_stream."""

    model_config = ConfigDict(strict=True, extra="ignore")

    inputs: str
    parameters: GenerateParameters = Field(default_factory=sampling_preset)


class CompatBody(GenerateBody):
    """Body of POST /: a generate body plus the `stream` switch."""

    stream: bool = False


class TokenizeParameters(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    truncate: UInt64 | None = None


class TokenizeBody(BaseModel):
    """Body of POST /tokenize: like /generate; only `parameters.truncate` matters."""

    model_config = ConfigDict(strict=True, extra="ignore")

    inputs: str
    parameters: TokenizeParameters = Field(default_factory=TokenizeParameters)

"""OpenAI request fields -> TGI generation parameters, and TGI finish reasons -> OpenAI's (pure).

The mapping is TGI's (reference §9.1, §10): temperature exactly 0 means greedy, otherwise
sampling is on (also when temperature is omitted); presence_penalty becomes
repetition_penalty = presence_penalty + 2 (quirk); top_logprobs becomes top_n_tokens. The result
is a `GenerateParameters`, so the same TGI validation (messages, limits) applies afterwards.
"""

from __future__ import annotations

from services.gateway.errors import GatewayError, ValidationError
from services.gateway.openai_schemas import ChatBody, CompletionBody
from services.gateway.schemas import GenerateParameters
from shared.messages import FinishReason

PRESENCE_TO_REPETITION = 2.0  # TGI: repetition_penalty = presence_penalty + 2.0


def tool_error(detail: str) -> GatewayError:
    return GatewayError(422, f"Tool error: {detail}", "tool_error")


def sampling_switch(temperature: float | None) -> tuple[bool, float | None]:
    """(do_sample, temperature): 0 -> greedy without temperature; else sampling."""
    if temperature == 0.0:
        return False, None
    return True, temperature


def stop_list(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


def check_chat_request(body: ChatBody) -> None:
    """Request-time rejections (real 422s, also when streaming): tools and n > 1."""
    uses_tools = bool(body.tools) and body.tool_choice != "none"
    if uses_tools and body.response_format is not None:
        raise tool_error("Grammar and tools are mutually exclusive")
    if uses_tools:
        raise tool_error("tools are not supported yet")
    if body.n is not None and body.n != 1:
        raise ValidationError(f"`n` must be 1 (one choice per request). Given: {body.n}")


def chat_parameters(body: ChatBody) -> GenerateParameters:
    do_sample, temperature = sampling_switch(body.temperature)
    repetition_penalty = (
        None if body.presence_penalty is None else body.presence_penalty + PRESENCE_TO_REPETITION
    )
    max_tokens = body.max_tokens if body.max_tokens is not None else body.max_completion_tokens
    return GenerateParameters(
        do_sample=do_sample,
        temperature=temperature,
        top_p=body.top_p,
        frequency_penalty=body.frequency_penalty,
        repetition_penalty=repetition_penalty,
        max_new_tokens=max_tokens,
        seed=body.seed,
        stop=stop_list(body.stop),
        top_n_tokens=body.top_logprobs,
        grammar=body.response_format,  # rejected by validation: grammars are not supported yet
        details=True,
    )


def completion_parameters(body: CompletionBody) -> GenerateParameters:
    do_sample, temperature = sampling_switch(body.temperature)
    return GenerateParameters(
        do_sample=do_sample,
        temperature=temperature,
        top_p=body.top_p,
        frequency_penalty=body.frequency_penalty,
        repetition_penalty=body.repetition_penalty,
        max_new_tokens=body.max_tokens,
        seed=body.seed,
        stop=stop_list(body.stop),
        details=True,
    )


def openai_finish_reason(reason: FinishReason) -> str:
    """Chat and non-stream completions: only EOS is renamed (`stop_sequence` stays: quirk)."""
    return "stop" if reason == FinishReason.EOS_TOKEN else reason.value

"""OpenAI request fields -> generation parameters, and finish reasons -> OpenAI's (pure).

The sampling switch is TGI's (reference §9.1, §10): temperature exactly 0 means greedy,
otherwise sampling is on (also when temperature is omitted). Unlike TGI, the OpenAI fields
keep OpenAI's meaning: `top_p: 1` is no nucleus cut, `presence_penalty` is OpenAI's additive
penalty, `logit_bias` is applied, `n` and `best_of` run several generations per prompt, and
`top_logprobs` (chat) or `logprobs` (completions) becomes top_n_tokens. The result is a
`GenerateParameters` plus the `OpenAISampling` TGI's body has no field for, so the same TGI
validation (limits, messages) applies afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.gateway.openai.schemas import ChatBody, CompletionBody, LogitBias, StructuredOutputs
from services.gateway.pipeline.constraints import first_of, response_format, structured_outputs
from services.gateway.pipeline.errors import GatewayError, ValidationError
from services.gateway.tgi.schemas import GenerateParameters
from shared.messages import Constraint, FinishReason

MAX_N = 128  # OpenAI's largest `n`
MAX_BEST_OF = 20  # OpenAI's largest `best_of`
MAX_BIAS = 100.0  # |logit_bias| values OpenAI accepts
MAX_SEED = 2**64 - 1


@dataclass(frozen=True)
class OpenAISampling:
    """What an OpenAI request asks of the sampler beyond TGI's parameters."""

    presence_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> bias
    constraint: Constraint | None = None  # response_format, structured_outputs or tools


@dataclass(frozen=True)
class Fanout:
    """How many generations run per prompt, and which of them are answered."""

    n: int = 1  # choices answered per prompt
    best_of: int = 1  # generations run per prompt (>= n); the n best mean logprobs are answered

    def choice_parameters(self, params: GenerateParameters) -> list[GenerateParameters]:
        """One parameter set per generation of a prompt: a given seed is offset per choice
        (seed + j), so that the choices differ, and replay stays exact."""
        if params.seed is None:
            return [params] * self.best_of
        return [
            params.model_copy(update={"seed": (params.seed + j) & MAX_SEED})
            for j in range(self.best_of)
        ]


def sampling_switch(temperature: float | None) -> tuple[bool, float | None]:
    """(do_sample, temperature): 0 -> greedy without temperature; else sampling."""
    if temperature == 0.0:
        return False, None
    return True, temperature


def nucleus(top_p: float | None) -> float | None:
    """OpenAI's top_p: 1 keeps every token (TGI would refuse it), so it is left out."""
    return None if top_p == 1.0 else top_p


def stop_list(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


def check_n(n: int | None) -> int:
    n = 1 if n is None else n
    if not 1 <= n <= MAX_N:
        raise ValidationError(f"`n` must be >= 1 and <= {MAX_N}. Given: {n}", param="n")
    return n


def check_presence_penalty(value: float | None) -> float:
    value = 0.0 if value is None else value
    if not -2.0 <= value <= 2.0:
        raise ValidationError(
            "`presence_penalty` must be >= -2.0 and <= 2.0", param="presence_penalty"
        )
    return value


def logit_bias_map(value: LogitBias | None, vocab_size: int) -> dict[int, float]:
    """OpenAI's {"token id": bias} map, checked: ids in the vocabulary, biases in
    [-100, 100]. TGI's list form is refused unless empty (it has no meaning to apply)."""
    if not value:
        return {}
    if isinstance(value, list):
        raise ValidationError(
            '`logit_bias` must map token ids to biases, as {"50256": -100}', param="logit_bias"
        )
    biases: dict[int, float] = {}
    for key, bias in value.items():
        if not key.strip().isdigit() or int(key) >= vocab_size:
            raise ValidationError(
                f"`logit_bias` key {key!r} is not a token id of this model (0 to {vocab_size - 1})",
                param="logit_bias",
            )
        if not -MAX_BIAS <= bias <= MAX_BIAS:
            raise ValidationError(
                f"`logit_bias` values must be >= -100 and <= 100. Given: {bias} for {key}",
                param="logit_bias",
            )
        biases[int(key)] = bias
    return biases


def check_chat_request(body: ChatBody) -> Fanout:
    """Request-time rejections (real errors, also when streaming): n, logprobs."""
    if body.top_logprobs and not body.logprobs:
        raise ValidationError("`top_logprobs` needs `logprobs` set to true", param="top_logprobs")
    n = check_n(body.n)
    return Fanout(n=n, best_of=n)


def check_completion_request(body: CompletionBody, max_client_batch_size: int) -> Fanout:
    if body.suffix is not None:
        raise GatewayError(
            422,
            "Suffix is not supported and can be achieved by preprocessing the prompt.",
            "suffix not supported",
            "validation",
            param="suffix",
        )
    if len(body.prompts) > max_client_batch_size:
        raise GatewayError(
            422,
            f"Number of prompts exceeds the maximum allowed batch size of {max_client_batch_size}",
            "batch size exceeded",
            "validation",
            param="prompt",
        )
    if body.echo and body.logprobs is not None:
        raise ValidationError(
            "`echo` with `logprobs` is not supported: the prompt tokens' alternatives are not "
            "computed (/generate's `decoder_input_details` gives the prompt's logprobs)",
            param="echo",
        )
    n = check_n(body.n)
    best_of = n if body.best_of is None else body.best_of
    if not n <= best_of <= MAX_BEST_OF:
        raise ValidationError(
            f"`best_of` must be >= `n` ({n}) and <= {MAX_BEST_OF}. Given: {best_of}",
            param="best_of",
        )
    if body.stream and best_of != n:
        raise ValidationError("`best_of` != `n` is not supported when streaming", param="best_of")
    return Fanout(n=n, best_of=best_of)


def chat_parameters(body: ChatBody) -> GenerateParameters:
    do_sample, temperature = sampling_switch(body.temperature)
    max_tokens = body.max_tokens if body.max_tokens is not None else body.max_completion_tokens
    return GenerateParameters(
        do_sample=do_sample,
        temperature=temperature,
        top_p=nucleus(body.top_p),
        frequency_penalty=body.frequency_penalty,
        max_new_tokens=max_tokens,
        seed=body.seed,
        stop=stop_list(body.stop),
        top_n_tokens=body.top_logprobs,
        details=True,
    )


def completion_parameters(body: CompletionBody) -> GenerateParameters:
    do_sample, temperature = sampling_switch(body.temperature)
    return GenerateParameters(
        do_sample=do_sample,
        temperature=temperature,
        top_p=nucleus(body.top_p),
        frequency_penalty=body.frequency_penalty,
        repetition_penalty=body.repetition_penalty,
        max_new_tokens=body.max_tokens,
        seed=body.seed,
        stop=stop_list(body.stop),
        top_n_tokens=body.logprobs,
        details=True,
    )


def openai_sampling(
    presence_penalty: float | None,
    logit_bias: LogitBias | None,
    vocab_size: int,
    constraint: Constraint | None = None,
) -> OpenAISampling:
    return OpenAISampling(
        presence_penalty=check_presence_penalty(presence_penalty),
        logit_bias=logit_bias_map(logit_bias, vocab_size),
        constraint=constraint,
    )


def body_constraint(body: StructuredOutputs) -> Constraint | None:
    """The constraint of `response_format`, else of vLLM's structured_outputs / guided_*."""
    return first_of(
        response_format(body.response_format),
        structured_outputs(body.structured_outputs, body.guided()),
    )


def openai_finish_reason(reason: FinishReason, has_tool_calls: bool = False) -> str:
    """OpenAI's values: an EOS token and a stop string both end with "stop"; an answer that
    is tool calls ends with "tool_calls" (unless cut by the length)."""
    if reason == FinishReason.LENGTH:
        return "length"
    return "tool_calls" if has_tool_calls else "stop"

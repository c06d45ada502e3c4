"""TGI's parameter validation, as pure functions (no I/O, no tokenizer).

Order matters and follows TGI's router (reference §4): `check_gates` runs before the
concurrency gate, `validate_parameters` after it, and `check_lengths` once the prompt is
tokenized. The first failure raises ValidationError with TGI's exact message.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from services.gateway.pipeline.constraints import tgi_grammar
from services.gateway.pipeline.errors import ValidationError
from services.gateway.tgi.schemas import GenerateParameters
from shared.messages import SamplingParams

MAX_SEED = 2**64 - 1
CHUNK_NEW_TOKENS = 1024  # TGI validates (and reports) max_new_tokens clamped to this


@dataclass(frozen=True)
class Limits:
    """Request limits resolved at start-up."""

    max_input_tokens: int
    max_total_tokens: int
    max_best_of: int = 2
    max_stop_sequences: int = 4
    max_top_n_tokens: int = 5


@dataclass(frozen=True)
class ValidatedParameters:
    """Parameters after validation, before tokenization."""

    sampling: SamplingParams  # what the worker gets (seed always set)
    is_sampling: bool  # do_sample or any warper set; greedy requests report seed null
    best_of: int  # >= 1
    max_new_tokens: int | None  # None: until the context is full
    stop: list[str]
    truncate: int | None
    top_n_tokens: int
    has_details: bool  # details or decoder_input_details
    has_decoder_input_details: bool
    return_full_text: bool | None  # None: the route's default
    priority: int = 0  # request lane: > 0 high, 0 normal, < 0 low
    ignore_eos: bool = False  # vLLM's extension on the OpenAI routes: run to max_new_tokens

    @property
    def reported_seed(self) -> int | None:
        return self.sampling.seed if self.is_sampling else None


def check_gates(params: GenerateParameters, limits: Limits, is_stream: bool) -> int:
    """The checks TGI runs before the concurrency gate; returns best_of (0 counts as 1)."""
    if is_stream:
        if params.best_of is not None and params.best_of != 1:
            raise ValidationError(
                "`best_of` != 1 is not supported when streaming tokens", param="best_of"
            )
        if params.decoder_input_details:
            raise ValidationError(
                "`decoder_input_details` == true is not supported when streaming tokens",
                param="decoder_input_details",
            )
        return 1
    best_of = params.best_of or 1
    if best_of > 1:
        if limits.max_best_of == 1:
            raise ValidationError(
                "`best_of` != 1 is not allowed for this endpoint", param="best_of"
            )
        if best_of > limits.max_best_of:
            raise ValidationError(
                f"`best_of` must be > 0 and <= {limits.max_best_of}. Given: {best_of}",
                param="best_of",
            )
    return best_of


def is_sampling(params: GenerateParameters) -> bool:
    return params.do_sample or any(
        value is not None
        for value in (params.temperature, params.top_k, params.top_p, params.typical_p)
    )


def validate_parameters(
    params: GenerateParameters,
    inputs: str,
    limits: Limits,
    rng: random.Random | None = None,
) -> ValidatedParameters:
    """TGI's checks 1-13 (and the grammar check); assigns a random seed when none is given."""
    best_of = params.best_of or 1
    sampling = is_sampling(params)
    if best_of > 1 and not sampling:
        raise ValidationError("you must use sampling when `best_of` is > 1", param="best_of")
    temperature = 1.0 if params.temperature is None else params.temperature
    if temperature <= 0.0:
        raise ValidationError("`temperature` must be strictly positive", param="temperature")
    repetition_penalty = 1.0 if params.repetition_penalty is None else params.repetition_penalty
    if repetition_penalty <= 0.0:
        raise ValidationError(
            "`repetition_penalty` must be strictly positive", param="repetition_penalty"
        )
    frequency_penalty = 0.0 if params.frequency_penalty is None else params.frequency_penalty
    if not -2.0 <= frequency_penalty <= 2.0:
        raise ValidationError(
            "`frequency_penalty` must be >= -2.0 and <= 2.0", param="frequency_penalty"
        )
    top_p = 1.0 if params.top_p is None else params.top_p
    if params.top_p is not None and not 0.0 < top_p < 1.0:
        raise ValidationError("`top_p` must be > 0.0 and < 1.0", param="top_p")
    typical_p = 1.0 if params.typical_p is None else params.typical_p
    if params.typical_p is not None and not 0.0 < typical_p < 1.0:
        raise ValidationError("`typical_p` must be > 0.0 and < 1.0", param="typical_p")
    top_k = 0 if params.top_k is None else params.top_k
    if params.top_k is not None and top_k <= 0:
        raise ValidationError("`top_k` must be strictly positive", param="top_k")
    if params.max_new_tokens == 0:
        raise ValidationError("`max_new_tokens` must be strictly positive", param="max_new_tokens")
    if len(params.stop) > limits.max_stop_sequences:
        raise ValidationError(
            f"`stop` supports up to {limits.max_stop_sequences} stop sequences. "
            f"Given: {len(params.stop)}",
            param="stop",
        )
    if params.seed is None:
        seed = (rng or random.SystemRandom()).randint(0, MAX_SEED)
    elif best_of > 1:
        raise ValidationError("`seed` must not be set when `best_of` > 1", param="seed")
    else:
        seed = params.seed
    top_n_tokens = params.top_n_tokens or 0
    if top_n_tokens > limits.max_top_n_tokens:
        raise ValidationError(
            f"`top_n_tokens` must be >= 0 and <= {limits.max_top_n_tokens}. Given: {top_n_tokens}",
            param="top_n_tokens",
        )
    if not inputs:
        raise ValidationError("`inputs` cannot be empty", param="inputs")
    if params.truncate is not None and not 0 < params.truncate <= limits.max_input_tokens:
        raise ValidationError(
            f"`truncate` must be strictly positive and less than {limits.max_input_tokens}. "
            f"Given: {params.truncate}",
            param="truncate",
        )
    constraint = tgi_grammar(params.grammar)  # checked once the prompt's length is (admit)
    return ValidatedParameters(
        sampling=SamplingParams(
            do_sample=sampling,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            typical_p=typical_p,
            repetition_penalty=repetition_penalty,
            frequency_penalty=frequency_penalty,
            seed=seed,
            top_n_tokens=top_n_tokens,
            watermark=params.watermark,
            prefill_logprobs=params.decoder_input_details,
            constraint=constraint,
        ),
        is_sampling=sampling,
        best_of=best_of,
        max_new_tokens=params.max_new_tokens,
        stop=list(params.stop),
        truncate=params.truncate,
        top_n_tokens=top_n_tokens,
        has_details=params.details or params.decoder_input_details,
        has_decoder_input_details=params.decoder_input_details,
        return_full_text=params.return_full_text,
        priority=params.priority or 0,
    )


def check_lengths(num_input_tokens: int, max_new_tokens: int | None, limits: Limits) -> int:
    """TGI's length rules (§5); returns the effective max_new_tokens.

    The prompt-length rule is checked first: with TGI's default limits (max_input =
    max_total - 1) a too-long prompt would otherwise always be reported as a total-length
    error, and clients expect `must have less than` for it (checklist 6). The total rule
    enforces the real sum and reports max_new_tokens clamped to 1024, as TGI does.
    """
    if num_input_tokens > limits.max_input_tokens:
        raise ValidationError(
            f"`inputs` must have less than {limits.max_input_tokens} tokens. "
            f"Given: {num_input_tokens}",
            param="inputs",
        )
    if max_new_tokens is None:
        max_new_tokens = limits.max_total_tokens - num_input_tokens
    if num_input_tokens + max_new_tokens > limits.max_total_tokens:
        raise ValidationError(
            f"`inputs` tokens + `max_new_tokens` must be <= {limits.max_total_tokens}. "
            f"Given: {num_input_tokens} `inputs` tokens and "
            f"{min(max_new_tokens, CHUNK_NEW_TOKENS)} `max_new_tokens`",
            param="inputs",
        )
    return max_new_tokens

"""Admission: the one path from a decoded request to generations ready to send, for every route
(TGI's, OpenAI's, SageMaker's, Vertex's).

Each dialect first applies its own request rules (TGI's gates, OpenAI's n/best_of/echo rules,
the chat template); then `admit` runs TGI's order for all of them: the concurrency slots
(one per generation, all or none: 429 otherwise), each generation's parameters validated, each
prompt tokenized once with the length rules. What comes out is one `Prepared` per generation,
prompt by prompt, and the slots they hold until their answer ends. A constraint (grammar,
response_format, tools) is checked last, after the lengths, as TGI orders it.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import TYPE_CHECKING, Any

import msgspec

from services.gateway.pipeline.constraints import check as check_constraint
from services.gateway.pipeline.errors import ValidationError, overloaded
from services.gateway.pipeline.results import Prepared
from services.gateway.pipeline.tokenizer import TokenizerError
from services.gateway.tgi.schemas import GenerateParameters
from services.gateway.tgi.validation import ValidatedParameters, check_lengths, validate_parameters
from shared.messages import AdapterRef

if TYPE_CHECKING:
    from services.gateway.state import GatewayState

LONG_PROMPT_CHARS = 10_000  # longer prompts tokenize off the event loop


class Admission:
    """The per-gateway concurrency gate (TGI's max_concurrent_requests semaphore, no waiting)."""

    def __init__(self, limit: int):
        self.limit = limit
        self.num_in_flight = 0

    def hold(self, num: int) -> Held:
        """`num` slots at once, or none: raises 429 overloaded."""
        if self.num_in_flight + num > self.limit:
            raise overloaded()
        self.num_in_flight += num
        return Held(self, num)


class Held:
    """Slots taken from an Admission; `release` gives them back once, however often called."""

    def __init__(self, admission: Admission, num: int):
        self.admission = admission
        self.num = num

    def release(self) -> None:
        if self.num:
            self.admission.num_in_flight = max(0, self.admission.num_in_flight - self.num)
            self.num = 0


@dataclasses.dataclass
class Admitted:
    """A request admitted: its generations, prompt by prompt, and their slots."""

    generations: list[Prepared]
    held: Held


async def admit(
    state: GatewayState,
    prompts: list[str],
    choice_params: list[GenerateParameters],
    arrived_at: float,
    *,
    add_special_tokens: bool = True,
    sampling_overrides: dict[str, Any] | None = None,
    response_id: str = "",
    ignore_eos: bool = False,
    adapter: AdapterRef | None = None,
) -> Admitted:
    """One generation per prompt and entry of `choice_params`; raises GatewayError (the slots
    taken are given back). `add_special_tokens`: False for chat prompts, whose template wrote
    them; `sampling_overrides`: SamplingParams fields a dialect sets beyond TGI's parameters;
    `ignore_eos`: generate until max_new_tokens (vLLM's extension, for benchmarks);
    `adapter`: the LoRA adapter every generation applies (pipeline/adapters.py resolves it)."""
    held = state.admission.hold(len(prompts) * len(choice_params))
    try:
        generations: list[Prepared] = []
        for prompt in prompts:
            validated = [
                overridden(validate_parameters(params, prompt, state.limits), sampling_overrides)
                for params in choice_params
            ]
            if ignore_eos:
                validated = [dataclasses.replace(v, ignore_eos=True) for v in validated]
            first = await prepare(
                state, prompt, validated[0], arrived_at, add_special_tokens, response_id
            )
            first.adapter = adapter
            constraint = first.params.sampling.constraint
            await check_constraint(constraint, not state.settings.disable_grammar_support)
            generations += [first] + [dataclasses.replace(first, params=v) for v in validated[1:]]
    except BaseException:
        held.release()
        raise
    constraint = generations[0].params.sampling.constraint if generations else None
    if constraint is not None:
        state.metrics.num_constrained[constraint.kind.value] += 1
    return Admitted(generations, held)


def overridden(
    params: ValidatedParameters, overrides: dict[str, Any] | None
) -> ValidatedParameters:
    if not overrides:
        return params
    sampling = msgspec.structs.replace(params.sampling, **overrides)
    return dataclasses.replace(params, sampling=sampling)


async def prepare(
    state: GatewayState,
    inputs: str,
    params: ValidatedParameters,
    arrived_at: float,
    add_special_tokens: bool,
    response_id: str,
) -> Prepared:
    """Tokenize (special tokens added unless told not to, left truncation) and apply the
    length rules."""
    encode, truncate = state.tokenizer.encode, params.truncate
    try:
        if len(inputs) > LONG_PROMPT_CHARS:
            input_ids = await asyncio.to_thread(encode, inputs, truncate, add_special_tokens)
        else:
            input_ids = encode(inputs, truncate, add_special_tokens)
    except TokenizerError as exc:
        raise ValidationError(f"tokenizer error {exc}", param="inputs") from exc
    max_new_tokens = check_lengths(len(input_ids), params.max_new_tokens, state.limits)
    return Prepared(inputs, input_ids, params, max_new_tokens, arrived_at, response_id)

"""Every structured-output dialect -> one `Constraint`, checked before the request is queued.

Dialects (reference: structured-output-tools-lora.md §A):
- TGI's `parameters.grammar` (and TGI's chat `response_format`): `{"type": "json" |
  "json_object" | "json_schema" | "regex", "value": ...}`;
- OpenAI's `response_format`: `text`, `json_object` (any object), `json_schema`
  (`{"json_schema": {"name", "schema", "strict"}}`), on chat and completions;
- vLLM's `structured_outputs` (`json`, `regex`, `choice`, `grammar`, `json_object`,
  `whitespace_pattern`) and the legacy top-level `guided_json`, `guided_regex`,
  `guided_choice`, `guided_grammar`, `guided_whitespace_pattern` vLLM now ignores (accepted here:
  clients still send them).

Shape errors are TGI's messages (422 on TGI routes, 400 on OpenAI's, by the route's error
shape). `check` then validates the grammar without a tokenizer (llguidance, off the event loop,
bounded by CHECK_TIMEOUT_S) and rejects what the worker could not compile, so a bad schema never
reaches a worker. Nothing is compiled here.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from services.gateway.pipeline.errors import ValidationError
from shared.grammar import (
    ANY_OBJECT_SCHEMA,
    GrammarError,
    choice_constraint,
    json_schema_constraint,
    make_constraint,
)
from shared.grammar import check as check_grammar
from shared.messages import Constraint, ConstraintKind

log = logging.getLogger(__name__)

CHECK_TIMEOUT_S = 5.0  # what a grammar's validation may take (vLLM gives regexes 5 s)
TGI_TYPES = ("json", "json_object", "json_schema", "regex")
GUIDED = {  # vLLM's structured_outputs keys and the legacy guided_* fields
    "json": "guided_json",
    "regex": "guided_regex",
    "choice": "guided_choice",
    "grammar": "guided_grammar",
}


def not_supported() -> ValidationError:
    return ValidationError("grammar is not supported", param="grammar")


def not_valid(detail: str, param: str = "grammar") -> ValidationError:
    return ValidationError(f"grammar is not valid: {detail}", param=param)


def tgi_grammar(grammar: Any, param: str = "grammar") -> Constraint | None:
    """TGI's adjacently tagged grammar object (None: no constraint)."""
    if grammar is None:
        return None
    if not isinstance(grammar, dict) or "type" not in grammar or "value" not in grammar:
        raise ValidationError(
            f"Failed to deserialize the JSON body into the target type: {param}: a grammar is "
            '{"type": "json" | "json_object" | "json_schema" | "regex", "value": ...}',
            param=param,
        )
    kind, value = grammar["type"], grammar["value"]
    if kind not in TGI_TYPES:
        raise ValidationError(
            f"Failed to deserialize the JSON body into the target type: {param}: unknown variant "
            f"`{kind}`, expected one of `json`, `json_object`, `json_schema`, `regex`",
            param=param,
        )
    if kind == "regex":
        if not isinstance(value, str):
            raise not_valid("a regex grammar's value must be a string", param)
        return make_constraint(ConstraintKind.REGEX, value)
    if kind == "json_schema":
        if not isinstance(value, dict) or "schema" not in value:
            raise not_valid("a json_schema grammar's value is {name, schema}", param)
        value = value["schema"]
    if not isinstance(value, dict | str):
        raise not_supported()  # TGI's words for a value that is neither object nor string
    return schema(value, None, param)


def schema(value: Any, whitespace: str | None, param: str) -> Constraint:
    try:
        return json_schema_constraint(value, whitespace)
    except GrammarError as exc:
        raise not_valid(str(exc), param) from exc


def response_format(value: dict[str, Any] | None) -> Constraint | None:
    """OpenAI's response_format, or TGI's grammar shape in its place (huggingface_hub sends
    `{"type": "json_object", "value": schema}`)."""
    if value is None:
        return None
    kind = value.get("type")
    if "value" in value:
        return tgi_grammar(value, "response_format")
    if kind == "text":
        return None
    if kind == "json_object":
        return make_constraint(ConstraintKind.JSON_SCHEMA, ANY_OBJECT_SCHEMA)
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict):
            raise ValidationError(
                "When response_format type is 'json_schema', the 'json_schema' field must be "
                "provided.",
                param="response_format",
            )
        return schema(spec.get("schema", {}), None, "response_format")
    raise ValidationError(
        f"`response_format.type` must be text, json_object or json_schema. Given: {kind!r}",
        param="response_format",
    )


def structured_outputs(options: dict[str, Any] | None, legacy: dict[str, Any]) -> Constraint | None:
    """vLLM's `structured_outputs` object, else its legacy `guided_*` fields (`legacy`: the
    body's guided_* values by name)."""
    options = dict(options or {})
    for key, old in GUIDED.items():
        if legacy.get(old) is not None:
            options.setdefault(key, legacy[old])
    whitespace = options.get("whitespace_pattern") or legacy.get("guided_whitespace_pattern")
    given = [key for key in ("json", "regex", "choice", "grammar") if options.get(key) is not None]
    if options.get("json_object"):
        given.append("json_object")
    if not given:
        return None
    if len(given) > 1:
        raise ValidationError(
            "You can only use one kind of constraints for structured outputs "
            f"('json', 'regex' or 'choice'). Given: {', '.join(given)}",
            param="structured_outputs",
        )
    key = given[0]
    value = options.get(key)
    try:
        if key == "json":
            return json_schema_constraint(value, whitespace)
        if key == "json_object":
            return json_schema_constraint(ANY_OBJECT_SCHEMA, whitespace)
        if key == "choice":
            return choice_constraint(value)
        if not isinstance(value, str):
            raise GrammarError(f"`{key}` must be a string")
        kind = ConstraintKind.REGEX if key == "regex" else ConstraintKind.GRAMMAR
        return make_constraint(kind, value)
    except GrammarError as exc:
        raise not_valid(str(exc), "structured_outputs") from exc


def first_of(*constraints: Constraint | None) -> Constraint | None:
    """The one constraint a request carries: `response_format` wins over structured_outputs
    (vLLM's rule)."""
    return next((c for c in constraints if c is not None), None)


async def check(constraint: Constraint | None, enabled: bool, param: str = "grammar") -> None:
    """Refuse a constraint the worker could not compile (ValidationError); a server launched
    with --disable-grammar-support refuses every constraint (TGI's message)."""
    if constraint is None:
        return
    if not enabled:
        raise not_supported()
    try:
        error = await asyncio.wait_for(
            asyncio.to_thread(check_grammar, constraint), CHECK_TIMEOUT_S
        )
    except TimeoutError as exc:
        raise not_valid(f"the grammar took over {CHECK_TIMEOUT_S:g} s to check", param) from exc
    if error:
        log.info("refused a %s constraint: %s", constraint.kind, error)
        raise not_valid(error, param)

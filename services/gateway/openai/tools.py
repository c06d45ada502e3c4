"""Tool calling on /v1/chat/completions: `tools` and `tool_choice` -> the template's tools and
the request's constraint, and the reader that turns the model's text into OpenAI tool calls.

- `none` (the default without tools): tools are shown to the template, the text is the answer.
- `required`: the output is a JSON array of `{"name", "parameters"}` (vLLM's schema: one item
  per call, at most one when `parallel_tool_calls` is false), each item a call.
- a named function (`{"type": "function", "function": {"name"}}`, or TGI's plain name): the
  output is that function's `parameters` object, the call's arguments.
- `auto` (the default with tools): the model writes freely; its own tool-call format is read
  back (tools/parsers.py): calls when it wrote some, text otherwise.

Reference: structured-output-tools-lora.md §B (OpenAI's contract, vLLM's messages and schema).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from services.gateway.openai.schemas import ChatBody
from services.gateway.pipeline.errors import GatewayError, ValidationError
from shared.grammar import json_schema_constraint
from shared.messages import Constraint

Mode = Literal["none", "auto", "required", "named"]
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
# TGI's default tool prompt, for templates that do not show tools
TOOL_PROMPT = (
    "Given the functions available, please respond with a JSON for a function call with its "
    "proper arguments that best answers the given prompt. Respond in the format "
    "{name: function name, parameters: dictionary of argument name and its value}."
    "Do not use variables."
)


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request's tools mean for its generation and its answer."""

    mode: Mode
    tools: list[dict[str, Any]]  # as the chat template receives them (OpenAI's shape)
    constraint: Constraint | None = None  # required / named: what the output must match
    name: str = ""  # named: the function called
    parallel: bool = True  # required: several calls allowed

    @property
    def reads_calls(self) -> bool:
        return self.mode in ("auto", "required", "named")


def tool_error(detail: str, param: str = "tools") -> GatewayError:
    """TGI's 422 tool_error (400 on the OpenAI routes)."""
    return GatewayError(422, f"Tool error: {detail}", "tool_error", param=param)


def checked_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI's function tools, checked; parameters default to an empty object."""
    checked = []
    for index, tool in enumerate(tools):
        function = tool.get("function")
        if tool.get("type", "function") != "function" or not isinstance(function, dict):
            raise tool_error(
                f"`tools[{index}]` must be {{'type': 'function', 'function': {{...}}}}"
            )
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise tool_error(f"`tools[{index}].function.name` must be a non-empty string")
        parameters = function.get("parameters", EMPTY_PARAMETERS)
        if not isinstance(parameters, dict):
            raise tool_error(f"`tools[{index}].function.parameters` must be a JSON schema object")
        checked.append({"type": "function", "function": {**function, "parameters": parameters}})
    return checked


def plan_tools(body: ChatBody) -> ToolPlan:
    """The request's tool plan; raises ValidationError (vLLM's messages) for bad input."""
    choice = body.tool_choice
    if body.tools is None:
        if choice is not None and choice != "none":
            raise ValidationError("When using `tool_choice`, `tools` must be set.", "tool_choice")
        return ToolPlan("none", [])
    if not body.tools:
        raise tool_error("`tools` must not be an empty array; leave it out to use no tools")
    tools = checked_tools(body.tools)
    by_name = {tool["function"]["name"]: tool["function"] for tool in tools}
    parallel = body.parallel_tool_calls is not False
    if choice == "none":  # TGI: the tools are not even shown to the model
        return ToolPlan("none", [])
    if choice is None or choice == "auto":
        return ToolPlan("auto", tools)
    if choice == "required":
        return ToolPlan("required", tools, required_constraint(tools, parallel), "", parallel)
    name = named_choice(choice)
    if name not in by_name:
        raise ValidationError(
            "The tool specified in `tool_choice` does not match any of the specified `tools`",
            "tool_choice",
        )
    parameters = by_name[name]["parameters"]
    return ToolPlan("named", tools, schema_constraint(parameters), name)


def named_choice(choice: str | dict[str, Any]) -> str:
    if isinstance(choice, str):
        return choice  # TGI: any other string names a function
    function = choice.get("function")
    if choice.get("type", "function") == "function" and isinstance(function, dict):
        name = function.get("name")
        if isinstance(name, str):
            return name
    raise ValidationError(
        f'Invalid value for `tool_choice`: {json.dumps(choice)}! Only named tools, "none", '
        '"auto" or "required" are supported.',
        "tool_choice",
    )


def schema_constraint(schema: dict[str, Any]) -> Constraint:
    return json_schema_constraint(schema)


def required_constraint(tools: list[dict[str, Any]], parallel: bool) -> Constraint:
    """vLLM's `required` schema: an array of calls, each naming one tool and giving its
    parameters; every tool's `$defs` are hoisted to the top (their `$ref`s point there)."""
    defs: dict[str, Any] = {}
    items = []
    for tool in tools:
        function = tool["function"]
        parameters = dict(function["parameters"])
        defs.update(parameters.pop("$defs", {}))
        items.append(
            {
                "type": "object",
                "properties": {"name": {"const": function["name"]}, "parameters": parameters},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
        )
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return json_schema_constraint(schema)


def template_messages(body: ChatBody) -> list[dict[str, Any]]:
    """The conversation as chat templates expect it: an assistant's tool calls with their
    arguments as objects (transformers' convention; OpenAI sends JSON text), tool results
    with their `tool_call_id`."""
    messages = []
    for message in body.messages:
        rendered = message.for_template()
        if message.tool_calls:
            rendered["tool_calls"] = [as_template_call(call) for call in message.tool_calls]
        messages.append(rendered)
    return messages


def as_template_call(call: dict[str, Any]) -> dict[str, Any]:
    function = call.get("function")
    if not isinstance(function, dict):
        return call  # the template decides what to make of it
    function = dict(function)
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            function["arguments"] = json.loads(arguments)
        except ValueError:
            pass  # a template may still show it as text
    return {**call, "function": function}


def with_tool_prompt(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]], tool_prompt: str | None
) -> list[dict[str, Any]]:
    """TGI's way for a template that does not show tools: the tools as JSON and the tool
    prompt appended to the last message."""
    if not messages:
        return messages
    last = dict(messages[-1])
    suffix = f"\n---\n{json.dumps(tools)}\n{tool_prompt or TOOL_PROMPT}"
    last["content"] = f"{last.get('content') or ''}{suffix}"
    return [*messages[:-1], last]

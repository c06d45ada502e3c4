"""The gateway's constraint and tool-call units (pure): every dialect to one Constraint with
TGI's and vLLM's messages, the tool plans, and the readers of the model's tool-call formats,
whole and streamed (markers split across deltas included)."""

from __future__ import annotations

import asyncio
import json

import pytest

from services.gateway.openai.schemas import ChatBody
from services.gateway.openai.tool_calls import (
    ToolCallStream,
    parse,
    parse_auto,
    parser_for_template,
)
from services.gateway.openai.tools import plan_tools
from services.gateway.pipeline.constraints import (
    check,
    response_format,
    structured_outputs,
    tgi_grammar,
)
from services.gateway.pipeline.errors import GatewayError, ValidationError
from shared.messages import ConstraintKind

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
TOOL = {"type": "function", "function": {"name": "f", "parameters": SCHEMA}}


def test_tgi_grammar_shapes():
    for grammar in (
        {"type": "json", "value": SCHEMA},
        {"type": "json_object", "value": SCHEMA},
        {"type": "json", "value": json.dumps(SCHEMA)},
        {"type": "json_schema", "value": {"name": "x", "schema": SCHEMA, "strict": True}},
    ):
        constraint = tgi_grammar(grammar)
        assert constraint.kind == ConstraintKind.JSON_SCHEMA
        assert json.loads(constraint.spec) == SCHEMA
    same = [tgi_grammar({"type": "json", "value": SCHEMA}) for _ in range(2)]
    assert same[0].key == same[1].key and len(same[0].key) == 64
    assert tgi_grammar({"type": "regex", "value": "a+"}).kind == ConstraintKind.REGEX
    with pytest.raises(ValidationError, match="^Input validation error: grammar is not supported$"):
        tgi_grammar({"type": "json", "value": [1]})  # TGI's words for a non-object value
    with pytest.raises(ValidationError, match="grammar is not valid: the schema is not valid JSON"):
        tgi_grammar({"type": "json", "value": "{oops"})
    with pytest.raises(ValidationError, match="unknown variant `lark`"):
        tgi_grammar({"type": "lark", "value": "x"})
    with pytest.raises(ValidationError, match="Failed to deserialize"):
        tgi_grammar({"type": "json"})


def test_openai_and_vllm_shapes():
    assert response_format({"type": "text"}) is None
    assert json.loads(response_format({"type": "json_object"}).spec) == {"type": "object"}
    wrapped = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}
    assert json.loads(response_format(wrapped).spec) == SCHEMA
    with pytest.raises(ValidationError, match="the 'json_schema' field must be provided"):
        response_format({"type": "json_schema"})
    choice = structured_outputs({"choice": ["a", "b"]}, {})
    assert choice.kind == ConstraintKind.CHOICE
    assert structured_outputs(None, {"guided_regex": "x+"}).kind == ConstraintKind.REGEX
    assert structured_outputs(None, {"guided_grammar": 'root ::= "a"'}).kind == "grammar"
    with pytest.raises(ValidationError, match="only use one kind of constraints"):
        structured_outputs({"regex": "a", "choice": ["a"]}, {})
    with pytest.raises(ValidationError, match="non-empty list"):
        structured_outputs(None, {"guided_choice": []})


def test_check_refuses_what_cannot_compile_and_honours_the_switch():
    asyncio.run(check(tgi_grammar({"type": "json", "value": SCHEMA}), True))
    for bad, says in [
        ({"type": "json", "value": {"type": "array", "uniqueItems": True}}, "uniqueItems"),
        ({"type": "regex", "value": "(?=a)"}, "look-around"),
        ({"type": "regex", "value": "ab\\"}, "incomplete escape"),
    ]:
        with pytest.raises(ValidationError, match=says):
            asyncio.run(check(tgi_grammar(bad), True))
    with pytest.raises(ValidationError, match="^Input validation error: grammar is not supported$"):
        asyncio.run(check(tgi_grammar({"type": "regex", "value": "a"}), False))


def chat(**fields) -> ChatBody:
    return ChatBody(messages=[{"role": "user", "content": "hi"}], **fields)


def test_tool_plans():
    assert plan_tools(chat()).mode == "none"
    assert plan_tools(chat(tools=[TOOL], tool_choice="none")).tools == []  # TGI: not shown
    auto = plan_tools(chat(tools=[TOOL]))
    assert auto.mode == "auto" and auto.constraint is None and auto.reads_calls
    required = plan_tools(chat(tools=[TOOL], tool_choice="required", parallel_tool_calls=False))
    schema = json.loads(required.constraint.spec)
    assert schema["maxItems"] == 1 and schema["items"]["anyOf"][0]["properties"]["name"] == {
        "const": "f"
    }
    named = plan_tools(
        chat(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "f"}})
    )
    assert named.mode == "named" and json.loads(named.constraint.spec) == SCHEMA
    for fields, says in [
        ({"tools": []}, "must not be an empty array"),
        ({"tool_choice": "auto"}, "`tools` must be set"),
        ({"tools": [TOOL], "tool_choice": "g"}, "does not match any"),
        ({"tools": [{"type": "function"}]}, r"tools\[0\]"),
        ({"tools": [TOOL], "tool_choice": {"type": "x"}}, "Invalid value for `tool_choice`"),
    ]:
        with pytest.raises(GatewayError, match=says):
            plan_tools(chat(**fields))


def test_parsers_read_each_format():
    hermes = 'Let me check.<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    content, calls = parse_auto("hermes", hermes + '<tool_call>{"name": "g", "arguments": {}}')
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"a": 1}), ("g", {})]
    content, calls = parse_auto("mistral", '[TOOL_CALLS][{"name": "f", "arguments": {"a": 2}}]')
    assert content == "" and calls[0].arguments == '{"a": 2}'
    content, calls = parse_auto(
        "llama3_json", '<|python_tag|>{"name": "f", "parameters": {"a": 3}}'
    )
    assert calls[0].name == "f" and json.loads(calls[0].arguments) == {"a": 3}
    assert parse_auto("hermes", "just text") == ("just text", [])
    assert parse_auto("llama3_json", "{not json") == ("{not json", [])
    assert parser_for_template("... <tool_call> ...") == "hermes"
    assert parser_for_template("[TOOL_CALLS] ...") == "mistral"
    assert parser_for_template("<|python_tag|>") == "llama3_json"
    assert parser_for_template("<tool_call>", "mistral") == "mistral"


def stream_deltas(plan, parser: str, pieces: list[str]) -> list[dict]:
    reader = ToolCallStream(plan, parser)
    deltas = [d for piece in pieces for d in reader.push(piece)]
    return deltas + reader.finish()


def test_stream_holds_back_a_marker_split_across_deltas():
    plan = plan_tools(chat(tools=[TOOL]))
    pieces = [
        "Sure",
        ", one moment <to",
        "ol_c",
        'all>{"name": "f", ',
        '"arguments": {"a": 1}}',
        "</tool_call>",
    ]
    deltas = stream_deltas(plan, "hermes", pieces)
    content = "".join(d.get("content", "") for d in deltas)
    assert content == "Sure, one moment "
    (calls,) = [d["tool_calls"] for d in deltas if "tool_calls" in d]
    assert calls[0]["index"] == 0 and calls[0]["function"] == {"name": "f", "arguments": '{"a": 1}'}
    text = stream_deltas(plan, "hermes", ["no ", "calls <", "here"])
    assert "".join(d["content"] for d in text) == "no calls <here"


def test_named_arguments_stream_as_they_come():
    plan = plan_tools(chat(tools=[TOOL], tool_choice="f"))
    deltas = stream_deltas(plan, "hermes", ['{"a"', ": 5}"])
    first, second = (d["tool_calls"][0] for d in deltas)
    assert first["id"].startswith("chatcmpl-tool-") and first["function"]["name"] == "f"
    assert first["function"]["arguments"] + second["function"]["arguments"] == '{"a": 5}'
    assert "id" not in second
    content, calls = parse(plan, "hermes", '{"a": 5}')
    assert content == "" and calls[0].arguments == '{"a": 5}'

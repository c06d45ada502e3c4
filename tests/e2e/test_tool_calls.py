"""Tool calling over real HTTP with the real clients: `required` and a named function give valid
tool calls (streamed and not) on any model; `auto` reads the calls a model writes in its own
format (the rigged Hermes-template model of tests/support/tiny_models.py writes one after the
assistant turn, and plain text when it continues a message); a conversation with a tool
result renders through the template; huggingface_hub's chat_completion(tools=...) works.
The SDK's stream accumulator must rebuild the same calls from the deltas."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from huggingface_hub import InferenceClient

from tests.e2e.test_openai_clients import accumulated

pytestmark = pytest.mark.integration

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "the weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 10},
                "unit": {"enum": ["C", "F"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 12}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, TIME]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
ASK = [{"role": "user", "content": "weather in Paris?"}]


@pytest.fixture(scope="module")
def tool_sdk(tool_cluster) -> openai.OpenAI:
    url = tool_cluster.gateway_urls[0]
    return openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)


def check_calls(message, names: set[str]) -> None:
    assert message.tool_calls, message
    assert len({call.id for call in message.tool_calls}) == len(message.tool_calls)
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("seed", [None, 1, 2])
def test_required_and_named_give_valid_calls(tool_sdk, seed):
    sdk = tool_sdk
    sampling = {"temperature": 0} if seed is None else {"seed": seed}
    for choice, names in [
        ("required", {"get_weather", "get_time"}),
        ({"type": "function", "function": {"name": "get_time"}}, {"get_time"}),
        ("get_weather", {"get_weather"}),  # TGI: a plain string names the function
    ]:
        args = dict(model="tgi", messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=300)
        answer = sdk.chat.completions.create(**args, **sampling)
        (whole,) = answer.choices
        assert whole.finish_reason == "tool_calls", whole
        check_calls(whole.message, names)
        streamed = accumulated(sdk.chat.completions.create(**args, **sampling, stream=True))
        (rebuilt,) = streamed.choices
        assert rebuilt.finish_reason == "tool_calls"
        check_calls(rebuilt.message, names)
        assert [(c.function.name, c.function.arguments) for c in rebuilt.message.tool_calls] == [
            (c.function.name, c.function.arguments) for c in whole.message.tool_calls
        ]


def test_parallel_tool_calls_false_gives_one_call(tool_sdk):
    sdk = tool_sdk
    for seed in range(3):
        answer = sdk.chat.completions.create(
            model="tgi",
            messages=ASK,
            tools=TOOLS,
            tool_choice="required",
            max_tokens=300,
            seed=seed,
            parallel_tool_calls=False,
        )
        assert len(answer.choices[0].message.tool_calls) == 1


def test_auto_reads_the_models_call_or_returns_text(tool_sdk):
    args = dict(model="tgi", tools=[WEATHER], max_tokens=20, temperature=0)
    answer = tool_sdk.chat.completions.create(messages=ASK, **args)
    (choice,) = answer.choices
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    (streamed,) = accumulated(
        tool_sdk.chat.completions.create(messages=ASK, **args, stream=True)
    ).choices
    assert streamed.finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls] == [
        ("get_weather", call.function.arguments)
    ]
    # continuing an assistant message, the model writes text: no calls
    prefill = [*ASK, {"role": "assistant", "content": "Sure"}]
    text = tool_sdk.chat.completions.create(messages=prefill, **args).choices[0]
    assert text.finish_reason == "stop" and not text.message.tool_calls
    assert text.message.content == " it is sunny in Paris."
    chunks = list(tool_sdk.chat.completions.create(messages=prefill, **args, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text.message.content
    assert not any(c.choices[0].delta.tool_calls for c in chunks)


def test_a_conversation_with_a_tool_result(tool_sdk, tool_cluster):
    first = (
        tool_sdk.chat.completions.create(
            model="tgi", messages=ASK, tools=[WEATHER], max_tokens=20, temperature=0
        )
        .choices[0]
        .message
    )
    (call,) = first.tool_calls
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "22C and sunny"},
    ]
    second = tool_sdk.chat.completions.create(
        model="tgi", messages=history, tools=[WEATHER], max_tokens=20, temperature=0
    )
    assert second.choices[0].finish_reason in ("tool_calls", "stop")
    url = tool_cluster.gateway_urls[0]
    response = httpx.post(f"{url}/chat_tokenize", json={"messages": history, "tools": [WEATHER]})
    prompt = "".join(token["text"] for token in response.json()["tokenize_response"])
    assert "<tool_response>\n22C and sunny\n</tool_response>" in prompt
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in prompt  # as an object
    assert '"description": "the weather in a city"' in prompt  # the tools, shown by the template


def test_inference_client_tools(tool_cluster, online):
    client = InferenceClient(base_url=tool_cluster.gateway_urls[0])
    answer = client.chat_completion(
        ASK, tools=TOOLS, tool_choice="required", max_tokens=300, seed=1
    )
    (choice,) = answer.choices
    for call in choice.message.tool_calls:
        arguments = call.function.arguments
        arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
        jsonschema.validate(arguments, SCHEMAS[call.function.name])


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"tools": []}, "`tools` must not be an empty array"),
        ({"tool_choice": "required"}, "When using `tool_choice`, `tools` must be set."),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "does not match any",
        ),
        ({"tools": TOOLS, "tool_choice": "nope"}, "does not match any"),
        ({"tools": [{"type": "function", "function": {}}]}, "function.name"),
        ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "mutually exclusive"),
    ],
)
def test_tool_errors_are_400(tiny_cluster, body, message):
    url = tiny_cluster.gateway_urls[0]
    response = httpx.post(f"{url}/v1/chat/completions", json={"messages": ASK, **body})
    assert response.status_code == 400, response.text
    assert message in response.json()["error"]["message"]

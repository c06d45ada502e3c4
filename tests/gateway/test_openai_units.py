"""Pure units of the OpenAI routes: chat templates, parameter mapping, response shapes."""

from __future__ import annotations

import json

import pytest

from services.gateway.body import parse_body
from services.gateway.chat_template import ChatTemplate, TemplateError, continue_final_message
from services.gateway.errors import BodyError, GatewayError, ValidationError
from services.gateway.generation import Finished, Token
from services.gateway.openai_format import (
    Envelope,
    chat_chunk,
    chat_completion,
    chat_usage_chunk,
    completion,
    completion_chunk,
    stream_error,
)
from services.gateway.openai_params import (
    chat_parameters,
    check_chat_request,
    completion_parameters,
    openai_finish_reason,
)
from services.gateway.openai_schemas import ChatBody, CompletionBody
from services.gateway.validation import Limits, validate_parameters
from shared.messages import FinishReason

# SmolLM2-Instruct's ChatML template (a default system prompt when none is given)
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)
LIMITS = Limits(max_input_tokens=32, max_total_tokens=64)
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
CONTINUE = [{"role": "user", "content": "Tell a story"}, {"role": "assistant", "content": "Once"}]


def hf_tokenizer(folder):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def tiny_template(tokenizer_dir) -> ChatTemplate:
    config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    template = ChatTemplate.from_folder(tokenizer_dir, config)
    assert template is not None
    return template


def test_tiny_template_renders_like_transformers(tokenizer_dir):
    template = tiny_template(tokenizer_dir)
    prompt = template.render(CHAT)
    assert prompt == "<s>system: Be brief.\n<s>user: Hi there\n<s>assistant:"
    hf = hf_tokenizer(tokenizer_dir)
    assert prompt == hf.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    # the assistant's last message is continued, not closed
    continued = template.render(CONTINUE)
    assert continued == "<s>user: Tell a story\n<s>assistant: Once"
    assert continued == hf.apply_chat_template(
        CONTINUE, tokenize=False, continue_final_message=True
    )


def test_chatml_template_and_continuation(tmp_path):
    template = ChatTemplate(SMOLLM2_TEMPLATE, "<|im_start|>", "<|im_end|>")
    user_only = [{"role": "user", "content": "Hi"}]
    assert template.render(user_only) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
        "Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert template.render(CHAT).startswith("<|im_start|>system\nBe brief.<|im_end|>\n")
    assert template.render(CONTINUE).endswith("<|im_start|>assistant\nOnce")
    # the same template found in chat_template.json, preferred over tokenizer_config.json
    (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": SMOLLM2_TEMPLATE}))
    found = ChatTemplate.from_folder(
        tmp_path, {"chat_template": "other", "bos_token": {"content": "<s>"}, "eos_token": "</s>"}
    )
    assert found is not None and found.source == SMOLLM2_TEMPLATE
    assert (found.bos_token, found.eos_token) == ("<s>", "</s>")


def test_template_sources_and_errors(tmp_path):
    assert ChatTemplate.from_folder(tmp_path, {}) is None
    (tmp_path / "chat_template.jinja").write_text("{{ bos_token }}{{ messages[0].content }}")
    assert ChatTemplate.from_folder(tmp_path, {"bos_token": "<s>"}).render(CHAT) == "<s>Be brief."
    named = [{"name": "tool_use", "template": "x"}, {"name": "default", "template": "{{ 1 }}"}]
    assert ChatTemplate.from_folder(tmp_path / "none", {"chat_template": named}).render([]) == "1"

    raising = ChatTemplate("{{ raise_exception('Conversation roles must alternate') }}")
    with pytest.raises(TemplateError) as caught:
        raising.render(CHAT)
    assert caught.value.status == 422 and caught.value.error_type == "template_error"
    assert caught.value.message == "Template error: Conversation roles must alternate"
    with pytest.raises(TemplateError, match="Template error: "):
        ChatTemplate("{% for %}").render(CHAT)  # syntax errors surface on use
    sandboxed = ChatTemplate("{{ messages.__class__.__mro__ }}")
    with pytest.raises(TemplateError):
        sandboxed.render(CHAT)
    assert ChatTemplate("{{ messages | tojson }}").render([{"role": "u", "content": "é"}]) == (
        '[{"role": "u", "content": "é"}]'
    )


def test_continue_final_message_cut():
    messages = [{"role": "assistant", "content": "Hello"}]
    assert continue_final_message("A: Hello</s>\nB:", messages) == "A: Hello"
    assert continue_final_message("A: Hello  \n", messages) == "A: Hello"
    assert continue_final_message("no match", messages) == "no match"
    assert continue_final_message("x Hello", [{"role": "user", "content": "Hello"}]) == "x Hello"
    # the LAST occurrence is cut after (the content may also appear earlier)
    assert continue_final_message("Hello Hello!", messages) == "Hello Hello"


def chat_body(**fields) -> ChatBody:
    return ChatBody.model_validate({"messages": [{"role": "user", "content": "Hi"}], **fields})


def validated(params):
    return validate_parameters(params, "prompt", LIMITS)


def test_chat_parameter_mapping():
    default = validated(chat_parameters(chat_body()))
    assert default.is_sampling and default.sampling.do_sample  # sampling on by default
    assert default.sampling.temperature == 1.0 and default.max_new_tokens is None
    assert default.has_details and default.top_n_tokens == 0

    greedy = validated(chat_parameters(chat_body(temperature=0)))
    assert not greedy.is_sampling and not greedy.sampling.do_sample
    assert greedy.sampling.temperature == 1.0 and greedy.reported_seed is None

    mapped = validated(
        chat_parameters(
            chat_body(
                temperature=0.7,
                top_p=0.9,
                presence_penalty=0.5,
                frequency_penalty=0.25,
                seed=7,
                stop="\n",
                max_completion_tokens=5,
                logprobs=True,
                top_logprobs=2,
            )
        )
    )
    sampling = mapped.sampling
    assert (sampling.temperature, sampling.top_p, sampling.seed) == (0.7, 0.9, 7)
    assert sampling.repetition_penalty == 2.5  # presence_penalty + 2 (TGI quirk)
    assert sampling.frequency_penalty == 0.25
    assert mapped.stop == ["\n"] and mapped.max_new_tokens == 5 and mapped.top_n_tokens == 2
    both = chat_parameters(chat_body(max_tokens=3, max_completion_tokens=9, stop=["a", "b"]))
    assert both.max_new_tokens == 3 and both.stop == ["a", "b"]


def test_chat_parameters_keep_tgi_validation():
    with pytest.raises(ValidationError, match=r"`top_p` must be > 0.0 and < 1.0"):
        validated(chat_parameters(chat_body(top_p=1.0)))
    with pytest.raises(ValidationError, match=r"`top_n_tokens` must be >= 0 and <= 5. Given: 10"):
        validated(chat_parameters(chat_body(logprobs=True, top_logprobs=10)))
    with pytest.raises(ValidationError, match="`frequency_penalty` must be >= -2.0 and <= 2.0"):
        validated(chat_parameters(chat_body(frequency_penalty=3.0)))
    with pytest.raises(ValidationError) as caught:
        validated(chat_parameters(chat_body(response_format={"type": "json", "value": {}})))
    assert caught.value.body() == {
        "error": "Input validation error: grammar is not supported",
        "error_type": "validation",
    }


def test_request_time_rejections():
    tool = {"type": "function", "function": {"name": "f", "parameters": {}}}
    with pytest.raises(GatewayError) as caught:
        check_chat_request(chat_body(tools=[tool]))
    assert caught.value.body() == {
        "error": "Tool error: tools are not supported yet",
        "error_type": "tool_error",
    }
    with pytest.raises(GatewayError, match="Grammar and tools are mutually exclusive"):
        check_chat_request(chat_body(tools=[tool], response_format={"type": "json", "value": {}}))
    check_chat_request(chat_body(tools=[tool], tool_choice="none"))  # tools switched off
    check_chat_request(chat_body(n=1))
    with pytest.raises(ValidationError, match="`n` must be 1"):
        check_chat_request(chat_body(n=2))


def test_completion_parameter_mapping():
    body = CompletionBody.model_validate(
        {"prompt": ["a", "b"], "temperature": 0, "repetition_penalty": 1.3, "stop": "x"}
    )
    assert body.prompts == ["a", "b"]
    params = validated(completion_parameters(body))
    assert not params.is_sampling and params.sampling.repetition_penalty == 1.3
    assert params.stop == ["x"]
    sampled = validated(completion_parameters(CompletionBody.model_validate({"prompt": "a"})))
    assert sampled.is_sampling


@pytest.mark.parametrize(
    "body",
    [
        {"messages": [{"role": "user"}]},  # neither content nor tool_calls
        {"messages": [{"role": "user", "content": "Hi"}], "stream_options": None},
        {"messages": [{"role": "user", "content": "Hi"}], "logit_bias": {"1": 2.0}},
        {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": -1},
        {"messages": "Hi"},
        {},
    ],
)
def test_chat_body_shape_rejections(body):
    with pytest.raises(BodyError) as caught:
        parse_body(json.dumps(body).encode(), "application/json", ChatBody)
    assert caught.value.status == 422
    assert caught.value.text.startswith("Failed to deserialize the JSON body into the target type")


def test_completion_body_rejects_empty_prompt_list():
    with pytest.raises(BodyError):
        parse_body(b'{"prompt": []}', "application/json", CompletionBody)
    parse_body(b'{"prompt": ""}', "application/json", CompletionBody)  # validation says empty


def test_content_chunks_flatten_to_text():
    body = ChatBody.model_validate(
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "What is this? "},
                        {"type": "image_url", "image_url": {"url": "https://x/cat.png"}},
                    ],
                    "name": "ann",
                }
            ]
        }
    )
    assert body.messages[0].for_template() == {
        "role": "user",
        "content": "What is this? ![](https://x/cat.png)",
        "name": "ann",
    }


@pytest.mark.parametrize(
    ("reason", "expected"),
    [
        (FinishReason.EOS_TOKEN, "stop"),
        (FinishReason.LENGTH, "length"),
        (FinishReason.STOP_SEQUENCE, "stop_sequence"),  # TGI quirk: not renamed
    ],
)
def test_finish_reason_mapping(reason, expected):
    assert openai_finish_reason(reason) == expected


def finished(reason=FinishReason.EOS_TOKEN, text="Hi!", num_input=5, num_generated=2):
    return Finished(text, reason, num_generated, num_input, None, 0.0, 0.0, 0.0, 0.0)


def test_response_shapes():
    meta = Envelope(model="m", created=123, system_fingerprint="0.1.0-native")
    top = Token(0, 9, " Ho", -1.5, False)
    tokens = [Token(1, 8, "Hi!", -0.25, False, [top]), Token(2, 2, "</s>", -0.5, True)]
    answer = chat_completion(meta, tokens, finished(), has_logprobs=True)
    assert answer["object"] == "chat.completion" and answer["id"] == ""
    assert answer["choices"][0]["message"] == {"role": "assistant", "content": "Hi!"}
    assert answer["choices"][0]["finish_reason"] == "stop"
    assert answer["choices"][0]["logprobs"]["content"][0] == {
        "token": "Hi!",
        "logprob": -0.25,
        "top_logprobs": [{"token": " Ho", "logprob": -1.5}],
    }
    assert answer["usage"] == {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}
    assert (
        chat_completion(meta, tokens, finished(), has_logprobs=False)["choices"][0]["logprobs"]
        is None
    )

    eos_chunk = chat_chunk(meta, tokens[1], finished(FinishReason.LENGTH), has_logprobs=False)
    assert eos_chunk["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert eos_chunk["choices"][0]["finish_reason"] == "length" and eos_chunk["usage"] is None
    first = chat_chunk(meta, tokens[0], None, has_logprobs=True)
    assert first["choices"][0]["finish_reason"] is None
    assert first["choices"][0]["logprobs"]["content"][0]["token"] == "Hi!"
    usage_chunk = chat_usage_chunk(meta, finished())
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["total_tokens"] == 7

    results = [([], finished(num_input=3)), ([], finished(FinishReason.LENGTH, num_input=4))]
    both = completion(meta, results)
    assert [c["index"] for c in both["choices"]] == [0, 1]
    assert [c["finish_reason"] for c in both["choices"]] == ["stop", "length"]
    assert both["usage"] == {"prompt_tokens": 7, "completion_tokens": 4, "total_tokens": 11}

    middle = completion_chunk(meta, 1, " a", None)
    assert middle["choices"][0]["finish_reason"] == "" and "usage" not in middle
    last = completion_chunk(meta, 1, "", finished())
    assert last["choices"][0]["finish_reason"] == "eos_token" and last["usage"]["prompt_tokens"]
    error = stream_error(GatewayError(429, "Model is overloaded", "overloaded"))
    assert error == {"error": {"message": "Model is overloaded", "http_status_code": 422}}

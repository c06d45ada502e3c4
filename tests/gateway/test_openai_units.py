"""Pure units of the OpenAI routes: chat templates, parameter mapping, rules, response shapes
and errors, checked against OpenAI's API reference."""

from __future__ import annotations

import json
import re

import pytest

from services.gateway.openai.errors import (
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    body_error_response,
    gateway_error_body,
    openai_status,
)
from services.gateway.openai.format import (
    Envelope,
    chat_choice,
    chat_chunk,
    completion_choice,
    completion_chunk,
    completion_logprobs,
    summed_usage,
)
from services.gateway.openai.params import (
    Fanout,
    chat_parameters,
    check_chat_request,
    check_completion_request,
    completion_parameters,
    logit_bias_map,
    openai_finish_reason,
    openai_sampling,
)
from services.gateway.openai.schemas import ChatBody, CompletionBody
from services.gateway.pipeline.body import parse_body
from services.gateway.pipeline.chat_template import (
    ChatTemplate,
    TemplateError,
    continue_final_message,
)
from services.gateway.pipeline.errors import BodyError, GatewayError, ValidationError
from services.gateway.pipeline.results import Finished, Token
from services.gateway.tgi.validation import Limits, validate_parameters
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


def completion_body(**fields) -> CompletionBody:
    return CompletionBody.model_validate({"prompt": "Hi", **fields})


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
    assert sampling.repetition_penalty == 1.0  # presence_penalty is OpenAI's, not TGI's + 2
    assert sampling.frequency_penalty == 0.25
    assert mapped.stop == ["\n"] and mapped.max_new_tokens == 5 and mapped.top_n_tokens == 2
    both = chat_parameters(chat_body(max_tokens=3, max_completion_tokens=9, stop=["a", "b"]))
    assert both.max_new_tokens == 3 and both.stop == ["a", "b"]
    # OpenAI's default top_p of 1 keeps every token: accepted (TGI refuses 1.0)
    assert validated(chat_parameters(chat_body(top_p=1.0))).sampling.top_p == 1.0


def test_openai_sampling_presence_penalty_and_logit_bias():
    extra = openai_sampling(0.5, {"5": 100, "7": -100.0, " 9": 2}, vocab_size=10)
    assert extra.presence_penalty == 0.5 and extra.logit_bias == {5: 100.0, 7: -100.0, 9: 2.0}
    assert openai_sampling(None, None, 10).logit_bias == {}
    assert logit_bias_map([], 10) == {}  # TGI's list form: nothing to apply
    for bias, says in [
        ({"10": 1.0}, "not a token id of this model (0 to 9)"),
        ({"-1": 1.0}, "not a token id"),
        ({"a": 1.0}, "not a token id"),
        ({"3": 100.5}, "must be >= -100 and <= 100"),
        ([0.5, 1.0], "must map token ids to biases"),
    ]:
        with pytest.raises(ValidationError, match=re.escape(says)) as caught:
            logit_bias_map(bias, 10)
        assert caught.value.param == "logit_bias"
    with pytest.raises(ValidationError, match="presence_penalty") as caught:
        openai_sampling(2.5, None, 10)
    assert caught.value.param == "presence_penalty"


def test_chat_parameters_keep_tgi_validation():
    with pytest.raises(ValidationError, match=r"`top_p` must be > 0.0 and < 1.0"):
        validated(chat_parameters(chat_body(top_p=1.5)))
    with pytest.raises(ValidationError, match=r"`top_n_tokens` must be >= 0 and <= 5. Given: 10"):
        validated(chat_parameters(chat_body(logprobs=True, top_logprobs=10)))
    with pytest.raises(ValidationError, match="`frequency_penalty` must be >= -2.0 and <= 2.0"):
        validated(chat_parameters(chat_body(frequency_penalty=3.0)))


def test_chat_request_rules():
    assert check_chat_request(chat_body(n=3)) == Fanout(n=3, best_of=3)
    for n in (0, 129):
        with pytest.raises(ValidationError, match="`n` must be >= 1 and <= 128") as caught:
            check_chat_request(chat_body(n=n))
        assert caught.value.param == "n"
    with pytest.raises(ValidationError, match="`top_logprobs` needs `logprobs`"):
        check_chat_request(chat_body(top_logprobs=2))


def test_completion_request_rules():
    assert check_completion_request(completion_body(n=2, best_of=5), 4) == Fanout(2, 5)
    assert check_completion_request(completion_body(n=2, stream=True), 4) == Fanout(2, 2)
    assert check_completion_request(completion_body(echo=True), 4) == Fanout()
    for fields, says, param in [
        ({"n": 3, "best_of": 2}, "`best_of` must be >= `n` (3) and <= 20. Given: 2", "best_of"),
        ({"best_of": 21}, "<= 20", "best_of"),
        ({"best_of": 2, "stream": True}, "not supported when streaming", "best_of"),
        ({"echo": True, "logprobs": 0}, "`echo` with `logprobs` is not supported", "echo"),
        ({"n": 0}, "`n` must be >= 1", "n"),
        ({"suffix": "x"}, "Suffix is not supported", "suffix"),
        ({"prompt": ["a"] * 5}, "maximum allowed batch size of 4", "prompt"),
    ]:
        with pytest.raises(GatewayError, match=re.escape(says)) as caught:
            check_completion_request(completion_body(**fields), 4)
        assert caught.value.param == param


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
    assert validated(completion_parameters(completion_body(logprobs=3))).top_n_tokens == 3


def test_choices_get_their_own_seeds():
    params = chat_parameters(chat_body(seed=2**64 - 1, temperature=0.5))
    seeds = [p.seed for p in Fanout(n=3, best_of=3).choice_parameters(params)]
    assert seeds == [2**64 - 1, 0, 1]  # seed + choice, wrapping like a uint64
    unseeded = Fanout(n=2, best_of=2).choice_parameters(chat_parameters(chat_body()))
    assert [p.seed for p in unseeded] == [None, None]  # validation draws one per choice
    a, b = (validated(p).sampling.seed for p in unseeded)
    assert a != b


@pytest.mark.parametrize(
    "body",
    [
        {"messages": [{"role": "user"}]},  # neither content nor tool_calls
        {"messages": [{"role": "user", "content": "Hi"}], "stream_options": None},
        {"messages": [{"role": "user", "content": "Hi"}], "logit_bias": {"1": "a"}},
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
    # the OpenAI routes answer it as OpenAI does: 400, invalid_request_error, the field
    response = body_error_response(caught.value)
    error = json.loads(response.body)["error"]
    assert response.status_code == 400 and error["type"] == "invalid_request_error"
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == caught.value.param


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
        (FinishReason.STOP_SEQUENCE, "stop"),  # OpenAI has one reason for both stops
    ],
)
def test_finish_reason_mapping(reason, expected):
    assert openai_finish_reason(reason) == expected


def finished(reason=FinishReason.EOS_TOKEN, text="Hi!", num_input=5, num_generated=2, stop=None):
    return Finished(text, reason, num_generated, num_input, None, 0.0, 0.0, 0.0, 0.0, [], stop)


META = Envelope(id="chatcmpl-1", model="m", created=123, system_fingerprint="0.1.0-native")


def test_chat_shapes():
    top = Token(0, 9, " Ho", -1.5, False)
    tokens = [Token(1, 8, "Hi!", -0.25, False, [top]), Token(2, 2, "</s>", None, True)]
    choice = chat_choice(0, tokens, finished(), has_logprobs=True)
    answer = META.answer("chat.completion", [choice], summed_usage([finished()], [finished()]))
    assert answer["object"] == "chat.completion" and answer["id"] == "chatcmpl-1"
    assert answer["choices"][0]["message"] == {"role": "assistant", "content": "Hi!"}
    assert answer["choices"][0]["finish_reason"] == "stop"
    assert answer["choices"][0]["logprobs"]["content"] == [
        {
            "token": "Hi!",
            "logprob": -0.25,
            "bytes": [72, 105, 33],
            "top_logprobs": [{"token": " Ho", "logprob": -1.5, "bytes": [32, 72, 111]}],
        },
        {"token": "</s>", "logprob": -9999.0, "bytes": list(b"</s>"), "top_logprobs": []},
    ]
    assert answer["usage"] == {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}
    assert chat_choice(0, tokens, finished(), has_logprobs=False)["logprobs"] is None
    # the stop string is not part of an OpenAI answer
    stopped = finished(FinishReason.STOP_SEQUENCE, text="Hi! The end.", stop=" The end.")
    assert chat_choice(1, [], stopped, False)["message"]["content"] == "Hi!"
    assert chat_choice(1, [], stopped, False)["finish_reason"] == "stop"


def test_chunks_carry_usage_only_when_asked():
    chunk = chat_chunk(META, 0, {"content": "Hi"}, tokens=None, finished=None)
    assert "usage" not in chunk and chunk["choices"][0]["finish_reason"] is None
    asked = Envelope("chatcmpl-1", "m", 123, "fp", has_usage_chunk=True)
    last = chat_chunk(asked, 0, {}, None, finished(FinishReason.LENGTH))
    assert last["usage"] is None and last["choices"][0]["finish_reason"] == "length"
    usage_chunk = asked.usage_chunk("chat.completion.chunk", summed_usage([finished()], []))
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["prompt_tokens"] == 5


def test_completion_shapes():
    meta = Envelope(id="cmpl-1", model="m", created=123, system_fingerprint="fp")
    results = [finished(num_input=3), finished(FinishReason.LENGTH, num_input=4)]
    choices = [completion_choice(i, "x", None, f) for i, f in enumerate(results)]
    both = meta.answer("text_completion", choices, summed_usage(results, results))
    assert both["id"] == "cmpl-1" and both["object"] == "text_completion"
    assert [c["index"] for c in both["choices"]] == [0, 1]
    assert [c["finish_reason"] for c in both["choices"]] == ["stop", "length"]
    assert both["usage"] == {"prompt_tokens": 7, "completion_tokens": 4, "total_tokens": 11}

    middle = completion_chunk(meta, 1, " a")
    assert middle["choices"][0]["finish_reason"] is None and "usage" not in middle
    last = completion_chunk(meta, 1, "", None, finished(FinishReason.STOP_SEQUENCE))
    assert last["choices"][0]["finish_reason"] == "stop" and "usage" not in last


def test_completion_logprobs_are_the_legacy_object():
    alt = Token(0, 9, " Ho", -1.5, False)
    tokens = [Token(1, 8, " Hi", -0.25, False, [alt]), Token(2, 7, "!", -0.5, False, [])]
    assert completion_logprobs(tokens, text_offset=4) == {
        "tokens": [" Hi", "!"],
        "token_logprobs": [-0.25, -0.5],
        "top_logprobs": [{" Ho": -1.5, " Hi": -0.25}, {"!": -0.5}],  # the chosen one included
        "text_offset": [4, 7],
    }


@pytest.mark.parametrize(
    ("error", "status", "kind", "param"),
    [
        (
            ValidationError("`max_new_tokens` must be > 0", "max_new_tokens"),
            400,
            "invalid_request_error",
            "max_tokens",
        ),
        (
            ValidationError("`inputs` cannot be empty", "inputs"),
            400,
            "invalid_request_error",
            "messages",
        ),
        (GatewayError(429, "Model is overloaded", "overloaded"), 429, "rate_limit_error", None),
        (GatewayError(424, "Request failed", "generation"), 500, "server_error", None),
        (GatewayError(503, "Service unavailable", "unavailable"), 503, "server_error", None),
    ],
)
def test_errors_have_openais_shape(error, status, kind, param):
    body = gateway_error_body(error, CHAT_FIELDS)
    assert body == {
        "error": {"message": error.message, "type": kind, "param": param, "code": error.error_type}
    }
    assert openai_status(error) == status
    if error.param == "inputs":
        assert gateway_error_body(error, COMPLETION_FIELDS)["error"]["param"] == "prompt"

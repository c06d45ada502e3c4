import random

import pytest

from services.gateway.pipeline.errors import ValidationError
from services.gateway.tgi.schemas import GenerateBody, GenerateParameters
from services.gateway.tgi.validation import Limits, check_gates, check_lengths, validate_parameters

LIMITS = Limits(
    max_input_tokens=100,
    max_total_tokens=200,
    max_best_of=2,
    max_stop_sequences=4,
    max_top_n_tokens=5,
)


def message(params: dict, inputs: str = "Hi", limits: Limits = LIMITS) -> str:
    with pytest.raises(ValidationError) as info:
        validate_parameters(GenerateParameters(**params), inputs, limits)
    assert info.value.status == 422 and info.value.error_type == "validation"
    return info.value.message


@pytest.mark.parametrize(
    "params,text",
    [
        ({"best_of": 2}, "you must use sampling when `best_of` is > 1"),
        ({"temperature": 0.0}, "`temperature` must be strictly positive"),
        ({"repetition_penalty": 0.0}, "`repetition_penalty` must be strictly positive"),
        ({"frequency_penalty": 2.5}, "`frequency_penalty` must be >= -2.0 and <= 2.0"),
        ({"top_p": 1.0}, "`top_p` must be > 0.0 and < 1.0"),
        ({"top_p": 0.0}, "`top_p` must be > 0.0 and < 1.0"),
        ({"typical_p": 1.0}, "`typical_p` must be > 0.0 and < 1.0"),
        ({"top_k": 0}, "`top_k` must be strictly positive"),
        ({"max_new_tokens": 0}, "`max_new_tokens` must be strictly positive"),
        ({"stop": ["a"] * 5}, "`stop` supports up to 4 stop sequences. Given: 5"),
        ({"best_of": 2, "do_sample": True, "seed": 3}, "`seed` must not be set when `best_of` > 1"),
        ({"top_n_tokens": 6}, "`top_n_tokens` must be >= 0 and <= 5. Given: 6"),
        ({"truncate": 0}, "`truncate` must be strictly positive and less than 100. Given: 0"),
        ({"truncate": 101}, "`truncate` must be strictly positive and less than 100. Given: 101"),
    ],
)
def test_messages(params, text):
    assert message(params) == f"Input validation error: {text}"


def test_empty_inputs():
    assert message({}, inputs="") == "Input validation error: `inputs` cannot be empty"


def test_first_failure_wins():
    assert "temperature" in message({"temperature": 0.0, "top_p": 1.0, "max_new_tokens": 0})


def test_valid_greedy_and_sampled_seed():
    greedy = validate_parameters(GenerateParameters(top_p=None), "Hi", LIMITS)
    assert not greedy.is_sampling and greedy.reported_seed is None
    assert not greedy.sampling.do_sample
    sampled = validate_parameters(GenerateParameters(top_p=0.9), "Hi", LIMITS, random.Random(1))
    assert sampled.is_sampling and sampled.sampling.do_sample
    assert sampled.reported_seed == sampled.sampling.seed
    fixed = validate_parameters(GenerateParameters(do_sample=True, seed=42), "Hi", LIMITS)
    assert fixed.reported_seed == 42


def test_defaults_quirk():
    absent = GenerateBody.model_validate({"inputs": "x"})
    present = GenerateBody.model_validate({"inputs": "x", "parameters": {}})
    assert absent.parameters.do_sample is True
    assert present.parameters.do_sample is False
    assert validate_parameters(absent.parameters, "x", LIMITS).is_sampling


def test_gates():
    with pytest.raises(ValidationError, match="not supported when streaming tokens"):
        check_gates(GenerateParameters(best_of=2), LIMITS, is_stream=True)
    with pytest.raises(ValidationError, match="`decoder_input_details` == true is not supported"):
        check_gates(GenerateParameters(decoder_input_details=True), LIMITS, is_stream=True)
    with pytest.raises(ValidationError) as info:
        check_gates(GenerateParameters(best_of=3), LIMITS, is_stream=False)
    assert info.value.message == "Input validation error: `best_of` must be > 0 and <= 2. Given: 3"
    with pytest.raises(ValidationError, match="`best_of` != 1 is not allowed for this endpoint"):
        check_gates(GenerateParameters(best_of=2), Limits(100, 200, max_best_of=1), False)
    assert check_gates(GenerateParameters(best_of=0), LIMITS, is_stream=False) == 1
    assert check_gates(GenerateParameters(best_of=2), LIMITS, is_stream=False) == 2


def test_lengths():
    assert check_lengths(10, None, LIMITS) == 190
    assert check_lengths(10, 190, LIMITS) == 190
    assert check_lengths(100, 5, LIMITS) == 5  # equality passes
    with pytest.raises(ValidationError) as info:
        check_lengths(101, 5, LIMITS)
    assert info.value.message == (
        "Input validation error: `inputs` must have less than 100 tokens. Given: 101"
    )
    with pytest.raises(ValidationError) as info:
        check_lengths(50, 151, LIMITS)
    assert info.value.message == (
        "Input validation error: `inputs` tokens + `max_new_tokens` must be <= 200. "
        "Given: 50 `inputs` tokens and 151 `max_new_tokens`"
    )


def test_total_length_message_reports_clamped_max_new_tokens():
    limits = Limits(max_input_tokens=100, max_total_tokens=2000)
    with pytest.raises(
        ValidationError, match="Given: 50 `inputs` tokens and 1024 `max_new_tokens`"
    ):
        check_lengths(50, 1990, limits)

import pytest

from services.gateway.pipeline.body import CONTENT_TYPE_TEXT, parse_body
from services.gateway.pipeline.errors import BodyError
from services.gateway.tgi.schemas import CompatBody, GenerateBody


def rejection(raw: bytes, content_type: str | None = "application/json", model=GenerateBody):
    with pytest.raises(BodyError) as info:
        parse_body(raw, content_type, model)
    return info.value.status, info.value.text


def test_content_type():
    assert rejection(b'{"inputs":"x"}', None) == (415, CONTENT_TYPE_TEXT)
    assert rejection(b'{"inputs":"x"}', "text/plain") == (415, CONTENT_TYPE_TEXT)
    assert parse_body(b'{"inputs":"x"}', "application/json; charset=utf-8", GenerateBody)


def test_malformed_json():
    status, text = rejection(b'{"inputs": "x"')
    assert status == 400 and text.startswith("Failed to parse the request body as JSON: ")


@pytest.mark.parametrize(
    "raw",
    [
        b'{"inputs":"x","parameters":{"max_new_tokens":-1}}',
        b'{"parameters":{}}',
        b'{"inputs":"x","parameters":{"stop":null}}',
        b'{"inputs":"x","parameters":{"do_sample":null}}',
        b'{"inputs":"x","parameters":{"details":null}}',
        b'{"inputs":"x","parameters":{"max_new_tokens":"5"}}',
        b'{"inputs":"x","parameters":{"max_new_tokens":1.5}}',
        b'{"inputs":5}',
        b"[1, 2]",
    ],
)
def test_wrong_shape(raw):
    status, text = rejection(raw)
    assert status == 422
    assert text.startswith("Failed to deserialize the JSON body into the target type: ")


def test_unknown_fields_ignored_and_nullable_fields():
    body = parse_body(
        b'{"inputs":"x","foo":1,"parameters":{"bar":2,"seed":null,"temperature":1,'
        b'"max_new_tokens":null,"top_n_tokens":null}}',
        "application/json",
        GenerateBody,
    )
    assert body.parameters.temperature == 1.0 and body.parameters.max_new_tokens is None
    compat = parse_body(b'{"inputs":"x","stream":true}', "application/json", CompatBody)
    assert compat.stream is True

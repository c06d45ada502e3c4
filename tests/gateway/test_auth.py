"""--api-key: the key is compared exactly (in constant time); only the scheme word is
case-insensitive."""

import pytest

from services.gateway.pipeline.auth import is_authorized


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        ("Bearer Secret123", True),
        ("bearer Secret123", True),
        ("BEARER Secret123", True),
        ("  Bearer   Secret123  ", True),
        ("Bearer secret123", False),
        ("BEARER SECRET123", False),
        ("Bearer Secret1234", False),
        ("Bearer Secret12", False),
        ("Secret123", False),
        ("Basic Secret123", False),
        ("Bearer", False),
        ("", False),
        (None, False),
    ],
)
def test_the_key_is_compared_exactly(header, expected):
    assert is_authorized("Secret123", header) is expected


def test_no_key_means_open_and_non_ascii_keys_work():
    assert is_authorized(None, None) and is_authorized("", "anything")
    sent = "Bearer clé".encode().decode("latin-1")  # what starlette hands over for UTF-8 bytes
    assert is_authorized("clé", sent) and not is_authorized("cle", sent)

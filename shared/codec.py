"""msgpack encoding of bus messages (see shared/messages.py)."""

from __future__ import annotations

from typing import Any, TypeVar, cast

import msgspec

T = TypeVar("T")

_encoder = msgspec.msgpack.Encoder()
_decoders: dict[type, msgspec.msgpack.Decoder[Any]] = {}


def encode(message: msgspec.Struct) -> bytes:
    """Encode a message as a msgpack map."""
    return _encoder.encode(message)


def decode(data: bytes, kind: type[T]) -> T:
    """Decode bytes into a message of `kind`; unknown fields are ignored.

    Raises msgspec.DecodeError (a ValueError) on malformed data.
    """
    decoder = _decoders.get(kind)
    if decoder is None:
        decoder = _decoders[kind] = msgspec.msgpack.Decoder(kind)
    return cast(T, decoder.decode(data))

"""msgpack codec for events. Decoding validates types and the contract's invariants in one pass."""

from __future__ import annotations

import functools
import operator
from typing import Any, TypeVar

import msgspec

from schemas.events import EVENT_TYPES, Event

E = TypeVar("E", bound=Event)

_encoder = msgspec.msgpack.Encoder()
_AnyEvent: Any = functools.reduce(operator.or_, EVENT_TYPES)
_any_decoder: msgspec.msgpack.Decoder[Any] = msgspec.msgpack.Decoder(_AnyEvent)
_decoders: dict[type[Event], msgspec.msgpack.Decoder[Any]] = {
    t: msgspec.msgpack.Decoder(t) for t in EVENT_TYPES
}


class DecodeError(ValueError):
    """A record is not a valid event. ``kind`` is ``decode`` (bytes are not an event of the expected type) or
    ``validation`` (an event whose fields violate the contract); the message names the field."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def encode(event: Event) -> bytes:
    return _encoder.encode(event)


def decode(data: bytes, event_type: type[E]) -> E:
    """Decode one record as ``event_type``; raises DecodeError."""
    return _decode(_decoders[event_type], data)  # type: ignore[no-any-return]


def decode_any(data: bytes) -> Event:
    """Decode a record of any event type (dispatching on its ``type`` tag); raises DecodeError."""
    return _decode(_any_decoder, data)  # type: ignore[no-any-return]


def _decode(decoder: msgspec.msgpack.Decoder[Any], data: bytes) -> Any:
    try:
        return decoder.decode(data)
    except msgspec.ValidationError as exc:
        # Type mismatches and __post_init__ contract errors both land here; a wrong ``type`` tag too.
        message = str(exc)
        kind = "decode" if message.endswith("at `$.type`") or "Expected `object`" in message else "validation"
        raise DecodeError(kind, message) from exc
    except msgspec.DecodeError as exc:
        raise DecodeError("decode", f"not a msgpack event: {exc}") from exc
    except RecursionError as exc:  # a free-form field (tools, content parts) nested without end
        raise DecodeError("decode", "not a msgpack event: nested too deeply") from exc

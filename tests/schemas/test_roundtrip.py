"""Every event survives encode -> decode unchanged, and decodes as its own type only."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from schemas import DecodeError, Event, decode, decode_any, encode
from schemas.events import EVENT_TYPES
from tests.strategies import ALL_EVENTS

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def test_every_event_type_has_a_strategy() -> None:
    assert set(ALL_EVENTS) == set(EVENT_TYPES)


@pytest.mark.parametrize("event_type", EVENT_TYPES, ids=lambda t: t.__name__)
@SETTINGS
@given(data=st.data())
def test_roundtrip(event_type: type[Event], data: st.DataObject) -> None:
    event = data.draw(ALL_EVENTS[event_type])
    wire = encode(event)
    assert decode(wire, event_type) == event
    assert decode_any(wire) == event
    assert type(decode_any(wire)) is event_type


@pytest.mark.parametrize("event_type", EVENT_TYPES, ids=lambda t: t.__name__)
@SETTINGS
@given(data=st.data())
def test_decoding_as_another_type_is_a_decode_error(event_type: type[Event], data: st.DataObject) -> None:
    wire = encode(data.draw(ALL_EVENTS[event_type]))
    other = next(t for t in EVENT_TYPES if t is not event_type)
    with pytest.raises(DecodeError) as info:
        decode(wire, other)
    assert info.value.kind == "decode"
    assert "$.type" in str(info.value)


@SETTINGS
@given(garbage=st.binary(max_size=64))
def test_garbage_never_decodes_silently(garbage: bytes) -> None:
    try:
        event = decode_any(garbage)
    except DecodeError as exc:
        assert exc.kind in ("decode", "validation")
    else:  # only a genuine encoded event may decode
        assert encode(event) == garbage

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


def test_a_record_nested_without_end_is_a_decode_error_not_a_crash() -> None:
    """Free-form fields (tools, content parts) take any JSON-like value: 100,000 levels of nesting in one must be
    a DecodeError (dead-lettered by the consumer), not a RecursionError that escapes the consumer's handling."""
    from schemas import Turn
    from tests.strategies import example_turn

    raw = encode(example_turn("s", 1, tools=[{"a": 1}]))
    tools = b"\x91\x81\xa1a\x01"  # [{"a": 1}]
    assert raw.count(tools) == 1
    deep = raw.replace(tools, b"\x91\x81\xa1a" + b"\x91" * 100_000 + b"\xc0")
    with pytest.raises(DecodeError, match="nested too deeply"):
        decode(deep, Turn)
    with pytest.raises(DecodeError):
        decode_any(deep)

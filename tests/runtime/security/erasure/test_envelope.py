"""Sealed values: they open only with their session's key, are told apart from plain events by their first byte,
and any change to them is refused."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from runtime.security.erasure.envelope import (
    OVERHEAD,
    Unreadable,
    is_sealed,
    key_id,
    new_key,
    seal,
    sealed_key_id,
    unseal,
)
from schemas import Event, encode
from tests.strategies import (
    dead_letters,
    judgments,
    paired_turns,
    samples,
    sessions_ended,
    teacher_scores,
    turns,
)

events = st.one_of(
    turns(), paired_turns(), judgments(), teacher_scores(), samples(), sessions_ended, dead_letters
)


@given(events)
def test_no_plain_event_looks_sealed_and_every_sealed_one_opens(event: Event) -> None:
    plain = encode(event)
    assert not is_sealed(plain)  # msgpack never writes 0xC1
    key = new_key()
    sealed = seal(key, "s-1", plain)
    assert is_sealed(sealed) and len(sealed) == len(plain) + OVERHEAD
    assert unseal(key, "s-1", sealed) == plain


def test_a_sealed_value_opens_only_with_its_key_for_its_session_and_unaltered() -> None:
    key, plain = new_key(), b"\x81\xa4text\xa9my secret"
    sealed = seal(key, "s-1", plain)
    assert b"my secret" not in sealed
    assert seal(key, "s-1", plain) != sealed  # a fresh nonce each time
    assert sealed_key_id(sealed) == key_id(key) != key_id(new_key())  # which key, not the key
    for other_key, session, value in (
        (new_key(), "s-1", sealed),  # another session's key (or the key destroyed and made anew)
        (key, "s-2", sealed),  # moved under another session
        (key, "s-1", sealed[:-1] + bytes([sealed[-1] ^ 1])),  # altered
        (key, "s-1", sealed[:2] + key_id(new_key()) + sealed[10:]),  # its header altered
        (key, "s-1", plain),  # never sealed
    ):
        with pytest.raises(Unreadable):
            unseal(other_key, session, value)

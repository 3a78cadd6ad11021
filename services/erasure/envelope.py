"""The sealed form of one record's value: AES-256-GCM under its session's key.

Layout: ``0xC1`` (a byte msgpack never writes, so a sealed value is never mistaken for a plain event and the
other way round), a format byte, a 12-byte random nonce, then the ciphertext with GCM's 16-byte tag. The session
id is the associated data: a value moved under another session's key does not open.
"""

from __future__ import annotations

import os
from typing import Final

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

MARK: Final = 0xC1
"""msgpack's one never-used byte (its spec: "never used"), first in every sealed value."""
FORMAT: Final = 1
NONCE_BYTES: Final = 12
TAG_BYTES: Final = 16
OVERHEAD: Final = 2 + NONCE_BYTES + TAG_BYTES
"""Bytes sealing adds to a value."""
KEY_BYTES: Final = 32


class Unreadable(ValueError):
    """A sealed value that does not open: its key is not this session's, or it was altered."""


def new_key() -> bytes:
    return os.urandom(KEY_BYTES)


def is_sealed(value: bytes) -> bool:
    return len(value) >= OVERHEAD and value[0] == MARK


def seal(key: bytes, session_id: str, plain: bytes) -> bytes:
    """``plain`` sealed under ``key`` for ``session_id``."""
    nonce = os.urandom(NONCE_BYTES)
    return bytes((MARK, FORMAT)) + nonce + AESGCM(key).encrypt(nonce, plain, session_id.encode())


def unseal(key: bytes, session_id: str, value: bytes) -> bytes:
    """The plain bytes of a sealed ``value``; ``Unreadable`` when it does not open with ``key`` for ``session_id``."""
    if not is_sealed(value) or value[1] != FORMAT:
        raise Unreadable("not a sealed value of a known format")
    try:
        return AESGCM(key).decrypt(value[2 : 2 + NONCE_BYTES], value[2 + NONCE_BYTES :], session_id.encode())
    except InvalidTag:
        raise Unreadable(f"does not open with session {session_id!r}'s key") from None

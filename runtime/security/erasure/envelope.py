"""The sealed form of one record's value: AES-256-GCM under its session's key.

Layout: ``0xC1`` (a byte msgpack never writes, so a sealed value is never mistaken for a plain event and the
other way round), a format byte, the key's id (the first 8 bytes of its SHA-256), a 12-byte random nonce, then
the ciphertext with GCM's 16-byte tag. The session id and the header are the associated data: a value moved under
another session's key does not open. The key id tells a record sealed under a key since destroyed (its session
was forgotten, and perhaps began again under a new key) from one that was altered.
"""

from __future__ import annotations

import hashlib
import os
from typing import Final

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

MARK: Final = 0xC1
"""msgpack's one never-used byte (its spec: "never used"), first in every sealed value."""
FORMAT: Final = 1
KEY_ID_BYTES: Final = 8
NONCE_BYTES: Final = 12
TAG_BYTES: Final = 16
_HEAD: Final = 2 + KEY_ID_BYTES
OVERHEAD: Final = _HEAD + NONCE_BYTES + TAG_BYTES
"""Bytes sealing adds to a value."""
KEY_BYTES: Final = 32


class Unreadable(ValueError):
    """A sealed value that does not open: it was altered, or moved under another session."""


def new_key() -> bytes:
    return os.urandom(KEY_BYTES)


def key_id(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()[:KEY_ID_BYTES]


def is_sealed(value: bytes) -> bool:
    return len(value) >= OVERHEAD and value[0] == MARK


def sealed_key_id(value: bytes) -> bytes:
    """The id of the key a sealed value was sealed under."""
    return value[2:_HEAD]


def seal(key: bytes, session_id: str, plain: bytes) -> bytes:
    """``plain`` sealed under ``key`` for ``session_id``."""
    head = bytes((MARK, FORMAT)) + key_id(key)
    nonce = os.urandom(NONCE_BYTES)
    return head + nonce + AESGCM(key).encrypt(nonce, plain, session_id.encode() + head)


def unseal(key: bytes, session_id: str, value: bytes) -> bytes:
    """The plain bytes of a sealed ``value``; ``Unreadable`` when it does not open with ``key`` for ``session_id``."""
    if not is_sealed(value) or value[1] != FORMAT:
        raise Unreadable("not a sealed value of a known format")
    head, nonce, sealed = value[:_HEAD], value[_HEAD : _HEAD + NONCE_BYTES], value[_HEAD + NONCE_BYTES :]
    try:
        return AESGCM(key).decrypt(nonce, sealed, session_id.encode() + head)
    except InvalidTag:
        raise Unreadable(f"does not open with session {session_id!r}'s key") from None

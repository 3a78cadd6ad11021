"""Stored responses: the conversation behind a Responses API answer, kept under its id so that a later request can
continue it by ``previous_response_id`` and send only what is new (openai-agents does; ``store`` defaults to true).

Kept in Redis at ``<redis.key_prefix>resp:<id>`` for ``proxy.stored_response_ttl_s``, as
``<session id> <payload>``: the session first, so ``turnstream forget`` finds and deletes it with its session, and
the payload sealed under that session's data key when sealing is on (the conversation is no more readable in Redis
than in Kafka). The id holds 128 random bits, and a stored response is found only by the key (user) that made it:
to anyone else it does not exist (404, as for an id never made).
"""

from __future__ import annotations

from typing import Any

import msgspec

from runtime.configuration.config import KafkaConfig
from runtime.security.erasure.envelope import Unreadable, is_sealed, seal, unseal
from runtime.security.erasure.sealing import session_keys
from runtime.transport.resp import PipelinedRedis, command

NO_SESSION = "-"
"""The session of a stored side turn (never recorded, so never in a session)."""


class Stored(msgspec.Struct, frozen=True):
    owner: str
    messages: list[dict[str, Any]]
    """The conversation after the instructions: what the next request continues."""


class Found(msgspec.Struct, frozen=True):
    session: str | None
    """The session the conversation was stored under (None: a side conversation of no session)."""
    messages: list[dict[str, Any]]
    size: int
    """Bytes of its stored record: what continuing it adds to a request."""


_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(Stored).decode


class ResponseStore:
    def __init__(self, redis: PipelinedRedis, key_prefix: str, ttl_s: int, kafka: KafkaConfig) -> None:
        self.redis = redis
        self.prefix = f"{key_prefix}resp:".encode()
        self.ttl = str(ttl_s).encode()
        self.kafka = kafka

    async def keep(
        self, response_id: str, owner: str, session: str | None, messages: list[dict[str, Any]]
    ) -> None:
        """Written to the connection before the answer's last bytes go out, so the client's next request, on any
        connection to the same Redis, finds it."""
        sid = session or NO_SESSION
        payload = _encode(Stored(owner, messages))
        store = session_keys(self.kafka) if session else None
        if store is not None:
            payload = seal(await store.for_writing(sid), sid, payload)
        self.redis.fire(
            command(
                b"SET", self.prefix + response_id.encode(), sid.encode() + b" " + payload, b"EX", self.ttl
            )
        )

    async def load(self, response_id: str, owner: str) -> Found | None:
        """A stored response the ``owner`` made; None when there is none for them."""
        value = await self.redis.send(command(b"GET", self.prefix + response_id.encode()))
        if not isinstance(value, bytes) or b" " not in value:
            return None
        sid, payload = value.decode("utf-8", "surrogateescape").split(" ", 1)[0], value.split(b" ", 1)[1]
        if is_sealed(payload):
            store = session_keys(self.kafka)
            key = await store.for_reading(sid) if store is not None else None
            if key is None:  # forgotten
                return None
            try:
                payload = unseal(key, sid, payload)
            except Unreadable:
                return None
        try:
            stored = _decode(payload)
        except msgspec.DecodeError:
            return None
        if stored.owner != owner:
            return None
        return Found(None if sid == NO_SESSION else sid, stored.messages, len(value))

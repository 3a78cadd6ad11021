"""Stored responses: the conversation behind a Responses API answer, kept under its id so that a later request can
continue it by ``previous_response_id`` and send only what is new (openai-agents does; ``store`` defaults to true).

Kept in Redis at ``<redis.key_prefix>resp:<id>`` for ``proxy.stored_response_ttl_s``, as
``<session id> <payload>``: the session first, so ``turnstream forget`` finds and deletes it with its session, and
the payload sealed under that session's data key when sealing is on (the conversation is no more readable in Redis
than in Kafka). The id holds 128 random bits, and a stored response is found only by the key (user) that made it:
to anyone else it does not exist (404, as for an id never made).

Each key's stored responses are indexed (``resp-owner:<user>``: id and size by time stored, and their bytes), so
one key keeps at most ``proxy.stored_responses_per_key`` of them and ``proxy.stored_bytes_per_key`` bytes: storing
past either drops that key's oldest, in the same script as the write (issue 55: one key's chain of continuations
took Redis from 49 MiB to 993 MiB).
"""

from __future__ import annotations

import time
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


_KEEP = b"""
local index, bytes_key, now, ttl_ms = KEYS[1], KEYS[2], tonumber(ARGV[3]), tonumber(ARGV[4])
local function drop(members)
  for _, member in ipairs(members) do
    local id, size = string.match(member, '^(%S+) (%d+)$')
    redis.call('DEL', ARGV[7] .. id)
    redis.call('ZREM', index, member)
    redis.call('DECRBY', bytes_key, size)
  end
end
drop(redis.call('ZRANGEBYSCORE', index, '-inf', now - ttl_ms))
redis.call('SET', ARGV[7] .. ARGV[1], ARGV[2], 'PX', ttl_ms)
redis.call('ZADD', index, now, ARGV[1] .. ' ' .. string.len(ARGV[2]))
local total = redis.call('INCRBY', bytes_key, string.len(ARGV[2]))
local count = redis.call('ZCARD', index)
while count > 1 and (count > tonumber(ARGV[5]) or total > tonumber(ARGV[6])) do
  drop(redis.call('ZRANGE', index, 0, 0))
  total = tonumber(redis.call('GET', bytes_key))
  count = count - 1
end
redis.call('PEXPIRE', index, ttl_ms)
redis.call('PEXPIRE', bytes_key, ttl_ms)
return count
"""
"""Store ``<prefix>resp:<ARGV[1]>`` = ARGV[2] and index it under its owner (KEYS[1], its bytes KEYS[2]); drop the
owner's expired entries, then its oldest while over ARGV[5] responses or ARGV[6] bytes (never the one just stored).
ARGV[3]: now (ms), ARGV[4]: the time to live (ms), ARGV[7]: the stored responses' key prefix."""

_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(Stored).decode


class ResponseStore:
    def __init__(
        self,
        redis: PipelinedRedis,
        key_prefix: str,
        ttl_s: int,
        kafka: KafkaConfig,
        per_key: int = 10_000,
        bytes_per_key: int = 512 * 1024 * 1024,
    ) -> None:
        self.redis = redis
        self.prefix = f"{key_prefix}resp:".encode()
        self.owners = f"{key_prefix}resp-owner:".encode()
        self.ttl_ms = b"%d" % (ttl_s * 1000)
        self.kafka = kafka
        self.caps = (b"%d" % per_key, b"%d" % bytes_per_key)

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
        index = self.owners + owner.encode()
        reply = self.redis.fire(
            command(
                b"EVAL",
                _KEEP,
                b"2",
                index,
                index + b":bytes",
                response_id.encode(),
                sid.encode() + b" " + payload,
                b"%d" % (time.time() * 1000),
                self.ttl_ms,
                *self.caps,
                self.prefix,
            )
        )
        if reply is not None:  # not connected yet (or no CLIENT REPLY): the write happens only when awaited
            await reply

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

"""Per-session turn numbers: one Redis ``INCR`` per main turn, so that proxy replicas behind a load balancer number
one session's turns 1, 2, 3 between them, over the pipelined client of ``runtime/transport/resp.py`` (a fifth of
the proxy's CPU per request went to redis-py's command path).

``number_once`` is the late path, for turns served while Redis was unreachable: the recorder numbers them when it
publishes them, and a Lua script keyed by the turn's nonce makes that idempotent (a resend after a crash gets the
number the first attempt got).
"""

from __future__ import annotations

import hashlib

from runtime.security.erasure.keys import fence_name
from runtime.transport.resp import PipelinedRedis, RedisReplyError, command

# KEYS[1] the session's counter, KEYS[2] its erasure fence (absent when not checked here: no empty key name, which
# a Redis ACL refuses); ARGV[1] how long the counter outlives the session's last turn. -1: the session was
# forgotten (no counter is made for it).
_NEXT = b"""
if KEYS[2] and redis.call('EXISTS', KEYS[2]) == 1 then return -1 end
local n = redis.call('INCR', KEYS[1]) redis.call('EXPIRE', KEYS[1], ARGV[1]) return n
"""
_NEXT_SHA = hashlib.sha1(_NEXT).hexdigest().encode()
FENCED = -1
"""``next``'s answer for a session ``turnstream forget`` fenced."""

_CURRENT = b"return tonumber(redis.call('GET', KEYS[1]) or '0')"

# KEYS[1] the session's counter, KEYS[2] the turn's nonce; ARGV[1] how long the nonce's number is remembered,
# ARGV[2] the counter's expiry.
_NUMBER_ONCE = b"""
local n = redis.call('GET', KEYS[2])
if n then return tonumber(n) end
n = redis.call('INCR', KEYS[1])
redis.call('EXPIRE', KEYS[1], ARGV[2])
redis.call('SET', KEYS[2], n, 'EX', ARGV[1])
return n
"""
NONCE_TTL_S = 30 * 86400


class TurnNumbers:
    def __init__(
        self,
        url: str,
        key_prefix: str,
        connect_timeout_s: float = 5.0,
        *,
        session_ttl_s: int = 30 * 86400,
        fences: bytes | None = None,
    ) -> None:
        self.redis = PipelinedRedis(url, connect_timeout_s)
        self.fences = fences
        """The data keys' prefix when their Redis is this one: ``next`` then also says whether the session is
        fenced (``FENCED``), in the same script, at no extra round trip."""
        self.prefix = f"{key_prefix}turns:".encode()
        self.nonce_prefix = f"{key_prefix}turn-nonce:".encode()
        self.ttl = str(session_ttl_s).encode()
        """Each counter expires this long after its session's last turn (``redis.session_ttl_s``): a session
        nobody continues leaves nothing behind in Redis."""

    async def next(self, session_id: str) -> int:
        """The session's next turn number (1 for its first turn); the counter's expiry starts again. ``FENCED`` for
        a forgotten session (when ``fences`` is set)."""
        counter = self.prefix + session_id.encode()
        if self.fences is not None:
            args: tuple[bytes, ...] = (b"2", counter, fence_name(self.fences, session_id), self.ttl)
        else:
            args = (b"1", counter, self.ttl)
        try:
            return int(await self.redis.send(command(b"EVALSHA", _NEXT_SHA, *args)))
        except RedisReplyError as exc:
            if "NOSCRIPT" not in str(exc):
                raise
            return int(await self.redis.send(command(b"EVAL", _NEXT, *args)))

    async def current(self, session_id: str) -> int:
        """The session's last turn number (0 before its first turn). A script, for an integer reply (the only kind
        besides status lines that this pipelined client reads) that creates no key (``INCRBY 0`` would, without
        an expiry)."""
        key = self.prefix + session_id.encode()
        return int(await self.redis.send(command(b"EVAL", _CURRENT, b"1", key)))

    async def number_once(self, session_id: str, nonce: bytes) -> int:
        """The session's next turn number for the turn identified by ``nonce``, the same one however often asked."""
        counter = self.prefix + session_id.encode()
        remembered = self.nonce_prefix + nonce.hex().encode()
        return int(
            await self.redis.send(
                command(b"EVAL", _NUMBER_ONCE, b"2", counter, remembered, str(NONCE_TTL_S).encode(), self.ttl)
            )
        )

    async def aclose(self) -> None:
        await self.redis.aclose()

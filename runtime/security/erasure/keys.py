"""Each session's data key: 32 random bytes in Redis, made by the first writer, deleted to forget the session.

Every process keeps the keys it used for ``cache_ttl_s``, so a busy session costs one Redis round trip per
interval rather than one per record; a forgotten key is therefore still usable by a process that held it for at
most that long (``turnstream forget`` waits it out before it checks). Keys never expire on their own: a record
outlives its key only by being forgotten.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterable

from runtime.security.erasure.envelope import KEY_BYTES, new_key
from runtime.transport.resp import PipelinedRedis, command

# KEYS[1] the session's key; ARGV[1] a fresh key, kept only if the session has none yet. Returns the one kept.
_GET_OR_SET = b"""
local kept = redis.call('GET', KEYS[1])
if kept then return kept end
redis.call('SET', KEYS[1], ARGV[1])
return ARGV[1]
"""


class SessionKeys:
    def __init__(
        self, redis: PipelinedRedis, prefix: str, *, cache_ttl_s: float = 30.0, cache_size: int = 65_536
    ) -> None:
        self.redis = redis
        self.prefix = prefix.encode()
        self.cache_ttl_s = cache_ttl_s
        self.cache_size = cache_size
        self._cache: OrderedDict[str, tuple[bytes | None, float]] = OrderedDict()

    def _cached(self, session_id: str) -> tuple[bool, bytes | None]:
        hit = self._cache.get(session_id)
        if hit is None or hit[1] < time.monotonic():
            return False, None
        self._cache.move_to_end(session_id)
        return True, hit[0]

    def _keep(self, session_id: str, key: bytes | None) -> None:
        self._cache[session_id] = (key, time.monotonic() + self.cache_ttl_s)
        self._cache.move_to_end(session_id)
        while len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)

    async def for_writing(self, session_id: str) -> bytes:
        """The session's key, made now if it has none (two writers racing get the same one)."""
        found, key = self._cached(session_id)
        if found and key is not None:
            return key
        name = self.prefix + session_id.encode()
        key = await self.redis.send(command(b"EVAL", _GET_OR_SET, b"1", name, new_key()))
        if not isinstance(key, bytes) or len(key) != KEY_BYTES:
            raise ValueError(f"the data key of session {session_id!r} in Redis is not {KEY_BYTES} bytes")
        self._keep(session_id, key)
        return key

    async def for_reading(self, session_id: str) -> bytes | None:
        """The session's key; None when it has none (forgotten, or never written)."""
        found, key = self._cached(session_id)
        if found:
            return key
        key = await self.redis.send(command(b"GET", self.prefix + session_id.encode()))
        if key is not None and (not isinstance(key, bytes) or len(key) != KEY_BYTES):
            raise ValueError(f"the data key of session {session_id!r} in Redis is not {KEY_BYTES} bytes")
        self._keep(session_id, key)
        return key

    async def destroy(self, session_ids: Iterable[str]) -> int:
        """Delete the sessions' keys (and this process's copies); how many existed."""
        sessions = list(session_ids)
        for s in sessions:
            self._cache.pop(s, None)
        names = [self.prefix + s.encode() for s in sessions]
        if not names:
            return 0
        return int(await self.redis.send(command(b"DEL", *names)))

"""Each session's data key: 32 random bytes in Redis, made by the first writer, deleted to forget the session.

Every process keeps the keys it used for ``cache_ttl_s``, so a busy session costs one Redis round trip per
interval rather than one per record; a forgotten key is therefore still usable by a process that held it for at
most that long (``turnstream forget`` waits it out before it checks). Keys never expire on their own: a record
outlives its key only by being forgotten.

Forgetting also fences the session, in the same step: for ``fence_s`` no writer can make it a new key, so a turn
that was on its way while ``turnstream forget`` ran (in a spool, a consumer's batch) is dropped, counted, instead
of being written again readable under a fresh key. The fence is named by the SHA-256 of the session id, never the
id itself (``\0`` keeps it apart from every data key: session ids are printable).
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from collections.abc import Iterable

from prometheus_client import Counter

from runtime.security.erasure.envelope import KEY_BYTES, new_key
from runtime.transport.resp import PipelinedRedis, command

UNREPLICATED = Counter(
    "turnstream_seal_keys_unreplicated_total",
    "Data keys used while the Redis master had fewer replicas connected than kafka.seal_keys_replicas",
)

# KEYS[1] the session's key, KEYS[2] its fence; ARGV[1] a fresh key, kept only if the session has none yet and is
# not fenced. Returns the one kept, or '' for a fenced session.
_GET_OR_SET = b"""
if redis.call('EXISTS', KEYS[2]) == 1 then return '' end
local kept = redis.call('GET', KEYS[1])
if kept then return kept end
redis.call('SET', KEYS[1], ARGV[1])
return ARGV[1]
"""


# KEYS: each session's key then its fence, in pairs; ARGV[1] the fence's life in seconds (0: none). Returns how
# many keys existed.
_DESTROY = b"""
local n = 0
for i = 1, #KEYS, 2 do
  n = n + redis.call('DEL', KEYS[i])
  if tonumber(ARGV[1]) > 0 then redis.call('SET', KEYS[i + 1], '1', 'EX', ARGV[1]) end
end
return n
"""


def fence_name(prefix: bytes, session_id: str) -> bytes:
    """The Redis key that fences a forgotten session: under the data keys' prefix, named by the id's SHA-256."""
    return prefix + b"\0fence:" + hashlib.sha256(session_id.encode()).hexdigest().encode()


class SessionForgotten(Exception):
    """The session was forgotten and is fenced: nothing may be written for it until the fence expires."""

    def __init__(self, session_id: str) -> None:
        super().__init__(f"session {session_id!r} was forgotten (turnstream forget) and is fenced")
        self.session_id = session_id


class SessionKeys:
    def __init__(
        self,
        redis: PipelinedRedis,
        prefix: str,
        *,
        cache_ttl_s: float = 30.0,
        cache_size: int = 65_536,
        replicas: int = 0,
        replicas_wait_ms: int = 2000,
    ) -> None:
        self.redis = redis
        self.replicas = replicas
        """``kafka.seal_keys_replicas``: the Redis replicas that must hold a key before it seals anything."""
        self.replicas_wait_ms = replicas_wait_ms
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

    def fence(self, session_id: str) -> bytes:
        return fence_name(self.prefix, session_id)

    async def for_writing(self, session_id: str) -> bytes:
        """The session's key, made now if it has none (two writers racing get the same one); ``SessionForgotten``
        while the session is fenced."""
        found, key = self._cached(session_id)
        if found and key is not None:
            return key
        name = self.prefix + session_id.encode()
        key = await self.redis.send(
            command(b"EVAL", _GET_OR_SET, b"2", name, self.fence(session_id), new_key())
        )
        if key == b"":
            raise SessionForgotten(session_id)
        if not isinstance(key, bytes) or len(key) != KEY_BYTES:
            raise ValueError(f"the data key of session {session_id!r} in Redis is not {KEY_BYTES} bytes")
        if self.replicas:
            await self._replicated(session_id)
        self._keep(session_id, key)
        return key

    async def _replicated(self, session_id: str) -> None:
        """Until the key is on ``replicas`` replicas (``WAIT``: every write of this connection so far), or on every
        replica the master has: with none connected (the others down) there is nothing a failover could promote,
        and the key is as safe as the master's own disk. Raises ConnectionError when a connected replica lags."""
        wait = command(b"WAIT", str(self.replicas).encode(), str(self.replicas_wait_ms).encode())
        copies = int(await self.redis.send(wait))
        if copies >= self.replicas:
            return
        info = await self.redis.send(command(b"INFO", b"replication"))
        connected = next(
            (
                int(line.split(b":")[1])
                for line in bytes(info).splitlines()
                if line.startswith(b"connected_slaves:")
            ),
            0,
        )
        if copies >= min(self.replicas, connected):
            UNREPLICATED.inc()
            return
        raise ConnectionError(
            f"the data key of session {session_id!r} reached {copies} of {self.replicas} Redis replicas in "
            f"{self.replicas_wait_ms} ms (kafka.seal_keys_replicas): nothing is sealed under it until it has"
        )

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

    async def destroy(self, session_ids: Iterable[str], fence_s: int = 0) -> int:
        """Delete the sessions' keys (and this process's copies) and fence each for ``fence_s`` seconds, each in
        one step; how many keys existed."""
        sessions = list(session_ids)
        for s in sessions:
            self._cache.pop(s, None)
        destroyed = 0
        for at in range(0, len(sessions), 500):
            names = [n for s in sessions[at : at + 500] for n in (self.prefix + s.encode(), self.fence(s))]
            args = (str(len(names)).encode(), *names, str(fence_s).encode())
            destroyed += int(await self.redis.send(command(b"EVAL", _DESTROY, *args)))
        return destroyed

"""The dispatcher's durable per-turn join in Redis.

Per turn ``<p>disp:t:<turn_id>``: a hash of the inputs seen (``eval:<judge>``, ``hint:<judge>``,
``teacher:<judge>``, the turn's token data, first/last arrival). ``<p>disp:done:<turn_id>``: the decision once
made (``emitted``, ``none``, ``dropped:<reason>``) or a claim ``pending|<owner>|<ms>`` held while a sample is being
produced. ``<p>disp:open``: open joins by first arrival (for the timeout sweep). ``<p>disp:s:<session>``: the
session already has a sample (the rl at-least-one rule). Every write is idempotent, and an input for a decided
turn changes nothing.
"""

from __future__ import annotations

from typing import cast

import redis.asyncio as aioredis

_ADD = """
local done = redis.call('GET', KEYS[2])
if done and string.sub(done, 1, 8) ~= 'pending|' then return {done, {}} end
redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2])
if ARGV[3] ~= '' then redis.call('HSETNX', KEYS[1], 'turn', ARGV[3]) end
redis.call('HSETNX', KEYS[1], 'first', ARGV[4])
redis.call('HSET', KEYS[1], 'last', ARGV[4])
redis.call('PEXPIRE', KEYS[1], ARGV[5])
redis.call('ZADD', KEYS[3], 'NX', ARGV[4], ARGV[6])
return {done or '', redis.call('HGETALL', KEYS[1])}
"""

# Close an expired join exactly once across replicas: only the caller whose ZREM removed it decides.
_EXPIRE = """
if redis.call('ZREM', KEYS[3], ARGV[1]) == 0 then return false end
if redis.call('EXISTS', KEYS[2]) == 1 then return false end
local fields = redis.call('HKEYS', KEYS[1])
redis.call('SET', KEYS[2], 'dropped:timeout', 'PX', ARGV[2])
redis.call('DEL', KEYS[1])
return fields
"""

_TAKE_OVER = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
  return 1
end
return 0
"""


class JoinStore:
    def __init__(self, redis: aioredis.Redis, prefix: str, *, join_ttl_s: float, dedupe_ttl_s: float) -> None:
        self.redis = redis
        self.p = prefix + "disp:"
        self.open_key = self.p + "open"
        self.join_ttl_ms = int(join_ttl_s * 1000)
        self.dedupe_ttl_ms = int(dedupe_ttl_s * 1000)
        self._add = redis.register_script(_ADD)
        self._expire = redis.register_script(_EXPIRE)
        self._take_over = redis.register_script(_TAKE_OVER)

    def _t(self, turn_id: str) -> str:
        return self.p + "t:" + turn_id

    def _d(self, turn_id: str) -> str:
        return self.p + "done:" + turn_id

    async def add(
        self, turn_id: str, field: str, value: bytes, turn_blob: bytes | None, now: float
    ) -> tuple[str | None, dict[str, bytes]]:
        """Record one input. Returns (the decision, or the claim, if there is one, else None; the join's fields).
        A decided turn's inputs are not recorded; a claimed one's are (its claim may have to be resolved)."""
        done, flat = await self._add(
            keys=[self._t(turn_id), self._d(turn_id), self.open_key],
            args=[field, value, turn_blob or b"", repr(now), self.join_ttl_ms, turn_id],
        )
        it = iter(cast(list[bytes], flat))  # field, value, ...: the client does not decode responses
        return _s(done) if done else None, {_s(k): v for k, v in zip(it, it, strict=True)}

    async def fields(self, turn_id: str) -> dict[str, bytes]:
        raw = cast(dict[bytes, bytes], await self.redis.hgetall(self._t(turn_id)))
        return {_s(k): v for k, v in raw.items()}

    async def decision(self, turn_id: str) -> str | None:
        raw = await self.redis.get(self._d(turn_id))
        return _s(raw) if raw is not None else None

    async def claim(self, turn_id: str, owner: str, now_ms: int) -> tuple[bool, str | None]:
        """Claim the right to emit: (True, None), or (False, the decision or claim already there)."""
        value = f"pending|{owner}|{now_ms}"
        if await self.redis.set(self._d(turn_id), value, nx=True, px=self.dedupe_ttl_ms):
            return True, None
        return False, await self.decision(turn_id)

    async def take_over(self, turn_id: str, old: str, owner: str, now_ms: int) -> bool:
        """Replace a stale claim with ours; False if someone else changed it first."""
        new = f"pending|{owner}|{now_ms}"
        return bool(await self._take_over(keys=[self._d(turn_id)], args=[old, new, self.dedupe_ttl_ms]))

    async def close(self, turn_id: str, decision: str, session_id: str | None = None) -> None:
        """Record the decision and free the join. ``session_id``: the session now has a sample."""
        pipe = self.redis.pipeline(transaction=True)
        pipe.set(self._d(turn_id), decision, px=self.dedupe_ttl_ms)
        pipe.delete(self._t(turn_id))
        pipe.zrem(self.open_key, turn_id)
        if session_id is not None:
            pipe.set(self.p + "s:" + session_id, b"1", px=self.dedupe_ttl_ms)
        await pipe.execute()

    async def session_has_sample(self, session_id: str) -> bool:
        return bool(await self.redis.exists(self.p + "s:" + session_id))

    async def expire(self, now: float, timeout_s: float, limit: int = 500) -> list[tuple[str, list[str]]]:
        """Drop joins open longer than ``timeout_s``: [(turn_id, the inputs it had)], each reported once."""
        out = []
        due = await self.redis.zrangebyscore(self.open_key, "-inf", now - timeout_s, start=0, num=limit)
        for raw in cast(list[bytes], due):  # members only (no scores asked for)
            turn_id = _s(raw)
            fields = await self._expire(
                keys=[self._t(turn_id), self._d(turn_id), self.open_key], args=[turn_id, self.dedupe_ttl_ms]
            )
            if fields is not None:
                out.append((turn_id, sorted(_s(f) for f in fields)))
        return out

    async def open_joins(self) -> int:
        return int(await self.redis.zcard(self.open_key))


def _s(v: bytes | str) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)

"""Per-session turn numbers: one Redis ``INCR`` per main turn, so that proxy replicas behind a load balancer number
one session's turns 1, 2, 3 between them, over the pipelined client of ``services/transport/resp.py`` (a fifth of
the proxy's CPU per request went to redis-py's command path).

``number_once`` is the late path, for turns served while Redis was unreachable: the recorder numbers them when it
publishes them, and a Lua script keyed by the turn's nonce makes that idempotent (a resend after a crash gets the
number the first attempt got).
"""

from __future__ import annotations

from services.transport.resp import PipelinedRedis, command

# KEYS[1] the session's counter, KEYS[2] the turn's nonce; ARGV[1] how long the nonce's number is remembered.
_NUMBER_ONCE = b"""
local n = redis.call('GET', KEYS[2])
if n then return tonumber(n) end
n = redis.call('INCR', KEYS[1])
redis.call('SET', KEYS[2], n, 'EX', ARGV[1])
return n
"""
NONCE_TTL_S = 30 * 86400


class TurnNumbers:
    def __init__(self, url: str, key_prefix: str, connect_timeout_s: float = 5.0) -> None:
        self.redis = PipelinedRedis(url, connect_timeout_s)
        self.prefix = f"{key_prefix}turns:".encode()
        self.nonce_prefix = f"{key_prefix}turn-nonce:".encode()

    async def next(self, session_id: str) -> int:
        """The session's next turn number (1 for its first turn)."""
        key = self.prefix + session_id.encode()
        return int(await self.redis.send(b"*2\r\n$4\r\nINCR\r\n$%d\r\n%s\r\n" % (len(key), key)))

    async def current(self, session_id: str) -> int:
        """The session's last turn number (0 before its first turn). ``INCRBY 0``: an integer reply, the only kind
        besides status lines that this pipelined client reads."""
        return int(await self.redis.send(command(b"INCRBY", self.prefix + session_id.encode(), b"0")))

    async def number_once(self, session_id: str, nonce: bytes) -> int:
        """The session's next turn number for the turn identified by ``nonce``, the same one however often asked."""
        counter = self.prefix + session_id.encode()
        remembered = self.nonce_prefix + nonce.hex().encode()
        return int(
            await self.redis.send(
                command(b"EVAL", _NUMBER_ONCE, b"2", counter, remembered, str(NONCE_TTL_S).encode())
            )
        )

    async def aclose(self) -> None:
        await self.redis.aclose()

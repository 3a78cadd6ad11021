"""One reloader at a time per policy engine, across proxies: a lease in Redis.

SGLang 0.5.23 keeps one pending weight update per server (``TokenizerManager.model_update_result``) and takes no
lock while generation is paused, so two proxies reloading the same engine at once make the second update replace
the first one's future; when both answer, the tokenizer manager's loop dies on ``InvalidStateError`` and the
server answers nothing until it is restarted (seen on Kubernetes with two proxies). A ``continue_generation`` from
one reloader in the middle of another's load is as bad: the load goes on unpaused and unlocked. So every
pause-load-continue, and the continue a reloader sends when it starts, runs under a lease: ``SET key token NX PX``,
renewed while held, released only by its holder (a script compares the token). A proxy that dies holding it frees
the engine when the lease expires. LoRA adapters need none: SGLang loads them under a lock of its own."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator

from prometheus_client import Counter

from runtime.transport.resp import PipelinedRedis, RedisReplyError, command

log = logging.getLogger("turnstream.proxy.engine_lease")

LEASES = Counter(
    "turnstream_proxy_engine_lease_total",
    "Tries to take a policy engine's reload lease: held, busy (another proxy reloads it), unavailable (Redis); "
    "lost: a holder found another holding it",
    ["outcome"],
)

_RELEASE = (
    b"if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) else return 0 end"
)
_RENEW = (
    b"local held = redis.call('GET', KEYS[1]) "
    b"if held == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end "
    b"if not held then redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2]) return 1 end "
    b"return 0"
)
"""Renew the lease, or take it back when it is gone and nobody else took it (a Sentinel failover can promote a
replica that never had the key): a holder whose load is under way keeps the engine."""


class EngineLease:
    """The lease on one engine. ``hold()`` raises what the Redis client raises (OSError, TimeoutError,
    RedisReplyError) when Redis cannot say."""

    def __init__(self, redis: PipelinedRedis, key: str, ttl_s: float = 30.0) -> None:
        self.redis = redis
        self.key = key.encode()
        self.ttl_ms = int(ttl_s * 1000)
        self.token = b""

    async def acquire(self) -> bool:
        token = uuid.uuid4().hex.encode()
        reply = await self.redis.send(command(b"SET", self.key, token, b"NX", b"PX", b"%d" % self.ttl_ms))
        if reply is None:
            return False
        self.token = token
        return True

    async def renew(self) -> bool:
        reply = await self.redis.send(
            command(b"EVAL", _RENEW, b"1", self.key, self.token, b"%d" % self.ttl_ms)
        )
        return bool(reply)

    async def release(self) -> None:
        token, self.token = self.token, b""
        if token:
            await self.redis.send(command(b"EVAL", _RELEASE, b"1", self.key, token))

    async def _keep(self) -> None:
        period = self.ttl_ms / 3000
        while True:
            await asyncio.sleep(period)
            try:
                if not await self.renew():
                    LEASES.labels("lost").inc()
                    log.error(
                        "the engine lease was taken by another while held (Redis could not be reached for longer "
                        "than the lease): two reloaders may act on the engine at once"
                    )
                    return
                period = self.ttl_ms / 3000
            except (OSError, TimeoutError, RedisReplyError) as exc:  # a failover: READONLY, then a new master
                log.warning("could not renew the engine lease; trying again", extra={"error": str(exc)})
                period = min(1.0, self.ttl_ms / 3000)

    @contextlib.asynccontextmanager
    async def hold(self) -> AsyncIterator[bool]:
        """True, renewed until the block ends: this reloader alone may pause, load or continue the engine;
        False: another holds it, or Redis cannot say (a load waits for Redis rather than risk the engine)."""
        try:
            mine = await self.acquire()
        except (OSError, TimeoutError, RedisReplyError) as exc:
            LEASES.labels("unavailable").inc()
            log.warning("could not take the engine's lease; the reload waits", extra={"error": str(exc)})
            mine = False
        else:
            LEASES.labels("held" if mine else "busy").inc()
        if not mine:
            yield False
            return
        keeper = asyncio.create_task(self._keep())
        try:
            yield True
        finally:
            keeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await keeper
            try:
                await self.release()
            except (OSError, TimeoutError) as exc:  # it expires by itself
                log.warning("could not release the engine lease", extra={"error": str(exc)})

"""The engine's reload lease on the real Redis: one holder at a time, renewed while held, released only by its
holder, freed by expiry when its holder died, and refused (not assumed) when Redis cannot say."""

from __future__ import annotations

import asyncio

import pytest

from runtime.configuration.config import RedisConfig
from runtime.transport.resp import PipelinedRedis, command
from services.proxy.engine_lease import EngineLease

pytestmark = pytest.mark.integration

ENGINE = "http://policy-0.policy:30000"


async def test_one_holder_at_a_time_renewed_while_held_released_by_its_holder(
    redis_config: RedisConfig,
) -> None:
    a_redis, b_redis = PipelinedRedis(redis_config.url), PipelinedRedis(redis_config.url)
    key = redis_config.reload_lease_key(ENGINE)
    a, b = EngineLease(a_redis, key, ttl_s=1.0), EngineLease(b_redis, key, ttl_s=1.0)
    try:
        async with a.hold() as mine:
            assert mine
            async with b.hold() as theirs:
                assert not theirs, "a second proxy took a held engine"
            await asyncio.sleep(3.0)  # three lease lengths: kept only by renewal
            assert not await b.acquire(), "the lease lapsed while its holder still held it"
            await b.release()  # not the holder: nothing happens
            assert not await b.acquire()
        async with b.hold() as theirs:
            assert theirs, "the lease was not released at the end of the block"
    finally:
        await a_redis.aclose()
        await b_redis.aclose()


async def test_a_dead_holders_lease_expires(redis_config: RedisConfig) -> None:
    redis = PipelinedRedis(redis_config.url)
    key = redis_config.reload_lease_key(ENGINE + "/")  # the same engine: a trailing slash names it too
    dead, live = EngineLease(redis, key, ttl_s=0.5), EngineLease(redis, redis_config.reload_lease_key(ENGINE))
    try:
        assert await dead.acquire()  # and never renewed nor released: its proxy died
        assert not await live.acquire()
        await asyncio.sleep(0.7)
        assert await live.acquire()
        await live.release()
    finally:
        await redis.aclose()


async def test_a_holder_takes_back_a_lease_redis_lost_but_never_one_another_holds(
    redis_config: RedisConfig,
) -> None:
    """A Sentinel failover can promote a replica that never had the lease: the holder, whose load is under way,
    takes it back at its next renewal (issue 55: the load went on with the lease free for another reloader). One
    another has taken meanwhile stays theirs, and the holder says it lost it."""
    redis = PipelinedRedis(redis_config.url)
    key = redis_config.reload_lease_key(ENGINE + "/failover")
    holder, other = EngineLease(redis, key, ttl_s=5.0), EngineLease(redis, key, ttl_s=5.0)
    try:
        assert await holder.acquire()
        await redis.send(command(b"DEL", key.encode()))  # the new master never had it
        assert await holder.renew() and not await other.acquire()
        await redis.send(command(b"DEL", key.encode()))
        assert await other.acquire()  # another got there first
        assert not await holder.renew() and not await holder.acquire()
        await other.release()
    finally:
        await redis.aclose()


async def test_without_redis_no_one_holds_the_engine() -> None:
    redis = PipelinedRedis("redis://127.0.0.1:1/0", connect_timeout_s=1.0)
    try:
        async with EngineLease(redis, "k").hold() as mine:
            assert not mine, "a reload went ahead with nothing to stop a second one"
    finally:
        await redis.aclose()

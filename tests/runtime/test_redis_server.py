"""The real Redis server the fixtures provide: what the dispatcher, pairer and proxy will keep state in."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis

from runtime.configuration.config import RedisConfig

pytestmark = pytest.mark.integration


async def test_real_redis_answers_and_keeps_namespaced_state(
    redis_client: aioredis.Redis, redis_config: RedisConfig
) -> None:
    info = await redis_client.info("server")
    assert int(str(info["redis_version"]).split(".")[0]) >= 6
    key = f"{redis_config.key_prefix}session:s1:turns"
    # INCR is atomic across clients: the basis of per-session turn numbering across proxy replicas.
    clients = [aioredis.from_url(redis_config.url) for _ in range(4)]
    try:
        results = await asyncio.gather(*(c.incr(key) for c in clients for _ in range(25)))
    finally:
        await asyncio.gather(*(c.aclose() for c in clients))
    assert sorted(results) == list(range(1, 101))
    assert int(await redis_client.get(key)) == 100

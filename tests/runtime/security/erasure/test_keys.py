"""Session data keys in the real Redis: made once by the first writer (racing writers agree), read back by
other processes, and gone for everyone once destroyed (a process's cached copy for at most its cache time)."""

from __future__ import annotations

import asyncio

import pytest
from redis import asyncio as aioredis

from runtime.configuration.config import RedisConfig
from runtime.security.erasure.envelope import KEY_BYTES
from runtime.security.erasure.keys import SessionKeys
from runtime.transport.resp import PipelinedRedis

pytestmark = pytest.mark.integration


def keys(redis_config: RedisConfig, cache_ttl_s: float = 30.0) -> SessionKeys:
    return SessionKeys(
        PipelinedRedis(redis_config.url), redis_config.key_prefix + "dek:", cache_ttl_s=cache_ttl_s
    )


async def test_the_first_writer_makes_the_key_and_every_process_reads_the_same(
    redis_config: RedisConfig, redis_client: aioredis.Redis
) -> None:
    writers = [keys(redis_config) for _ in range(4)]
    made = await asyncio.gather(*(w.for_writing("s-1") for w in writers for _ in range(5)))
    assert len(set(made)) == 1 and len(made[0]) == KEY_BYTES
    assert await keys(redis_config).for_reading("s-1") == made[0]
    assert await keys(redis_config).for_reading("never-written") is None
    assert await redis_client.ttl(redis_config.key_prefix + "dek:s-1") == -1, (
        "a key lives as long as its records"
    )
    # A key with a CRLF or any byte in it comes back whole (the pipelined client's bulk replies).
    await redis_client.set(redis_config.key_prefix + "dek:s-2", b"\r\n" * 16)
    assert await keys(redis_config).for_reading("s-2") == b"\r\n" * 16


async def test_a_destroyed_key_is_gone_for_everyone_after_their_cache_time(redis_config: RedisConfig) -> None:
    writer, reader = keys(redis_config), keys(redis_config, cache_ttl_s=2.0)
    key = await writer.for_writing("s-1")
    assert await reader.for_reading("s-1") == key
    assert await keys(redis_config).destroy(["s-1", "unknown"]) == 1
    assert await keys(redis_config).for_reading("s-1") is None
    assert (
        await reader.for_reading("s-1") == key
    )  # its copy, for at most its cache time (2 s: a busy machine)
    await asyncio.sleep(2.1)
    assert await reader.for_reading("s-1") is None
    assert await writer.destroy(["s-1"]) == 0 and await writer.for_reading("s-1") is None
    assert await writer.for_writing("s-1") != key, "a session written again after forgetting gets a new key"

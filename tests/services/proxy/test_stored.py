"""Stored responses on the real Redis: each key keeps a bounded number and size of them, its oldest dropped first,
in the same script as the write (issue 55, row 2: one key's chain of stored conversations took Redis from 49 MiB
to 993 MiB)."""

from __future__ import annotations

import pytest

from runtime.configuration.config import KafkaConfig, RedisConfig
from runtime.transport.resp import PipelinedRedis, command
from services.proxy.stored import ResponseStore

pytestmark = pytest.mark.integration


def said(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


async def test_each_key_keeps_its_newest_stored_responses_within_its_caps(
    redis_config: RedisConfig, kafka_config: KafkaConfig
) -> None:
    redis = PipelinedRedis(redis_config.url)
    store = ResponseStore(redis, redis_config.key_prefix, 600, kafka_config, per_key=3, bytes_per_key=20_000)
    try:
        for i in range(5):  # alice stores five small ones: her three newest stay
            await store.keep(f"resp_a{i}", "alice", None, said(f"question {i}"))
        await store.keep("resp_b0", "bob", None, said("bob's"))
        kept = [await store.load(f"resp_a{i}", "alice") for i in range(5)]
        assert [k is not None for k in kept] == [False, False, True, True, True]
        assert kept[4] is not None and kept[4].messages == said("question 4")
        # Two of 12,000 bytes: the count cap drops her oldest small one, then the 20,000-byte cap drops the rest
        # of her older ones, oldest first, until what is left fits; bob keeps his.
        await store.keep("resp_big", "alice", None, said("x" * 12_000))
        assert [i for i in range(5) if await store.load(f"resp_a{i}", "alice") is not None] == [3, 4]
        await store.keep("resp_big2", "alice", None, said("z" * 12_000))
        assert [i for i in range(5) if await store.load(f"resp_a{i}", "alice") is not None] == []
        assert (
            await store.load("resp_big", "alice") is None
            and await store.load("resp_big2", "alice") is not None
        )
        assert await store.load("resp_b0", "bob") is not None
        # The index holds what is stored, and its bytes add up.
        index = redis_config.key_prefix.encode() + b"resp-owner:alice"
        value = await redis.send(command(b"GET", f"{redis_config.key_prefix}resp:resp_big2".encode()))
        assert await redis.send(command(b"ZCARD", index)) == 1
        assert int(await redis.send(command(b"GET", index + b":bytes"))) == len(value)
        # One larger than the whole cap is still kept (alone): a request may carry it, and its continuation works.
        await store.keep("resp_huge", "alice", None, said("y" * 30_000))
        assert (
            await store.load("resp_huge", "alice") is not None
            and await store.load("resp_big", "alice") is None
        )
    finally:
        await redis.aclose()

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator, Iterator

import pytest
import redis.asyncio as aioredis

from services.config import KafkaConfig, RedisConfig
from services.topics import create_topics
from tests.infra import Service, start_kafka, start_redis

os.environ.setdefault("OMP_NUM_THREADS", "1")

TEST_PARTITIONS = 3


@pytest.fixture(scope="session")
def kafka_service() -> Iterator[Service]:
    service = start_kafka()
    yield service
    if not os.environ.get("TURNSTREAM_KEEP_SERVICES"):
        service.stop()


@pytest.fixture(scope="session")
def redis_service() -> Iterator[Service]:
    service = start_redis()
    yield service
    if not os.environ.get("TURNSTREAM_KEEP_SERVICES"):
        service.stop()


@pytest.fixture
def namespace() -> str:
    """A topic namespace of this test's own, so tests never see each other's records."""
    return f"test-{uuid.uuid4().hex[:12]}."


@pytest.fixture
def kafka_config(kafka_service: Service, namespace: str) -> KafkaConfig:
    return KafkaConfig(
        bootstrap=kafka_service.address,
        namespace=namespace,
        client_id="turnstream-test",
        poll_timeout_ms=200,
        session_timeout_ms=6000,
        heartbeat_interval_ms=500,
    )


@pytest.fixture
async def kafka(kafka_config: KafkaConfig) -> KafkaConfig:
    """The test's namespace, with every turnstream topic created (3 partitions each, 1 for weights)."""
    await create_topics(kafka_config, partitions=TEST_PARTITIONS)
    return kafka_config


@pytest.fixture
async def redis_config(redis_service: Service) -> RedisConfig:
    return RedisConfig(url=redis_service.address, key_prefix=f"test-{uuid.uuid4().hex[:12]}:")


@pytest.fixture
async def redis_client(redis_config: RedisConfig) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.from_url(redis_config.url)
    yield client
    keys = [k async for k in client.scan_iter(match=f"{redis_config.key_prefix}*")]
    if keys:
        await client.delete(*keys)
    await client.aclose()

"""Kafka goes away in the middle of traffic: users notice nothing, and every turn arrives exactly once. The broker
stopped is one of this module's own (the run's shared broker serves the other tests meanwhile)."""

from __future__ import annotations

import asyncio
from collections import Counter

import httpx
import pytest

from runtime.configuration.config import KafkaConfig
from runtime.messaging.topics import create_topics
from tests.infra import Service, _script, moved_to
from tests.services.proxy.conftest import ProxyProcess, wait_for_turns

pytestmark = pytest.mark.integration


@pytest.fixture
async def own_kafka(private_kafka: Service, kafka_config: KafkaConfig) -> KafkaConfig:
    """The test's namespace on the module's own broker, with its topics."""
    config = moved_to(kafka_config, private_kafka)
    await create_topics(config, partitions=3)
    return config


async def test_broker_outage_loses_and_duplicates_nothing(
    own_kafka: KafkaConfig, private_kafka: Service, proxy_env: dict[str, str]
) -> None:
    proxy = ProxyProcess({**proxy_env, **own_kafka.client_env()})
    try:
        await outage(proxy, own_kafka, private_kafka)
    finally:
        proxy.stop()


async def outage(proxy: ProxyProcess, kafka: KafkaConfig, broker: Service) -> None:
    expected: list[str] = []

    async def traffic(http: httpx.AsyncClient, session: str, n: int) -> None:
        history = []
        for _ in range(n):
            history.append({"role": "user", "content": f"turn {len(history)}"})
            r = await http.post(
                proxy.url + "/v1/chat/completions",
                headers={"X-Session-Id": session},
                json={"messages": history, "max_tokens": 2, "temperature": 0},
            )
            assert r.status_code == 200, r.text
            history.append(r.json()["choices"][0]["message"])
            expected.append(f"{session}:{len(history) // 2}")

    async with httpx.AsyncClient(timeout=60) as http:
        await asyncio.gather(traffic(http, "before-a", 3), traffic(http, "before-b", 3))
        await asyncio.to_thread(_script, "kafka.sh", "stop", broker.script_env)
        try:
            # Users are served while the broker is down; their turns wait in the spool.
            await asyncio.gather(*(traffic(http, f"during-{i}", 4) for i in range(3)))
            health = (await http.get(proxy.url + "/healthz")).json()
            assert health["status"] == "ok" and health["spool_pending"] > 0
        finally:
            await asyncio.to_thread(_script, "kafka.sh", "start", broker.script_env)
        await traffic(http, "after", 3)

    turns = await wait_for_turns(kafka, len(expected), timeout=120)
    counts = Counter(t.turn_id for t in turns)
    assert set(counts) == set(expected), "no turn lost"
    assert max(counts.values()) == 1, "no turn duplicated"
    async with httpx.AsyncClient(timeout=60) as http:
        assert (await http.get(proxy.url + "/healthz")).json()["spool_pending"] == 0

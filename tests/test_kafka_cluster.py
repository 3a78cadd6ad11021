"""Kafka as a replicated cluster: three KRaft nodes (scripts/kafka-cluster.sh) on which ``turnstream topics create``
makes three copies of every partition with ``min.insync.replicas`` 2, read from the cluster, and the whole pipeline
(the fault rig of tests/test_faults.py: proxy, pairer, judge, teacher, dispatcher as real processes) loses nothing
when a broker is killed (``kill -9``) in the middle of traffic: every answered turn recorded once, every sample made
once, with the broker left dead and with it restarted."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from runtime.configuration.config import KafkaConfig, RedisConfig
from runtime.messaging.topics import create_topics, describe_topics
from tests.conftest import namespaced_kafka
from tests.infra import script_output
from tests.test_faults import SESSIONS, TURNS, Pipeline, Stages, assert_exact, run_with_fault

pytestmark = pytest.mark.integration


def cluster(*args: str) -> str:
    return script_output("kafka-cluster.sh", *args)


@pytest.fixture(scope="module")
def cluster_bootstrap() -> Iterator[str]:
    cluster("start")
    yield cluster("bootstrap")
    cluster("reset")


@pytest.fixture
async def cluster_kafka(cluster_bootstrap: str, redis_config: RedisConfig) -> KafkaConfig:
    kafka = namespaced_kafka(cluster_bootstrap, redis_config.url, f"test-{uuid.uuid4().hex[:12]}.")
    await create_topics(kafka, partitions=3)
    return kafka


async def test_topics_get_three_copies_and_need_two(cluster_kafka: KafkaConfig) -> None:
    states = await describe_topics(cluster_kafka)
    assert {s.replicas for s in states} == {3}
    assert {s.configs.get("min.insync.replicas") for s in states} == {"2"}


@pytest.mark.parametrize("restarted", [False, True], ids=["left-dead", "restarted"])
def test_a_broker_killed_in_the_middle_of_traffic_loses_nothing(
    restarted: bool, cluster_kafka: KafkaConfig, redis_config: RedisConfig, smollm2_path: Path, tmp_path: Path
) -> None:
    pipe = Pipeline(
        cluster_kafka,
        redis_config.url,
        redis_config.key_prefix,
        str(smollm2_path),
        tmp_path / "rig",
        Stages(policy_latency_ms=250, judge_latency_ms=20),
    )
    pipe.start()
    victim = "2"

    def fault() -> None:
        cluster("kill", victim)
        if restarted:
            time.sleep(3.0)
            cluster("start-node", victim)

    try:
        acc = run_with_fault(pipe, cluster_kafka, fault)
        assert_exact(acc, pipe)
        assert acc.found["samples"] == SESSIONS * (TURNS - 1) + len(acc.recorded_unanswered)
    finally:
        pipe.stop()
        if not restarted:
            cluster("start-node", victim)

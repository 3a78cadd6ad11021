"""High availability, both parts at once: Kafka as a replicated cluster (three KRaft nodes, scripts/kafka-cluster.sh)
on which ``turnstream topics create`` makes three copies of every partition with ``min.insync.replicas`` 2, and a
Redis that fails over (a master, a replica and three Sentinels, scripts/redis-sentinel.sh, with the ACL users of
runtime/security/redis_users.py: the default user off, `probe` for PING on the servers), named to every
service by one ``redis+sentinel://`` URL that carries the service's user and the Sentinels' client user. Both of
turnstream's Redis clients (redis-py's and the proxy's pipelined one) follow a failover; and the whole pipeline
(the fault rig of tests/test_faults.py: proxy, pairer, judge, teacher, dispatcher as real processes) on the cluster
and the Sentinel set loses nothing when a broker is killed (``kill -9``) and the Redis master is killed in the
middle of traffic, with both left dead and with both started again: every answered turn recorded once, every
sample made once, and every record readable (``seal_keys_replicas`` 1: a sealing key seals nothing before the
replica has it). One cluster and one Sentinel set serve the module."""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from runtime.configuration.config import KafkaConfig
from runtime.messaging.topics import create_topics, describe_topics
from runtime.transport.redis_urls import redis_client, sentinel_target
from runtime.transport.resp import PipelinedRedis, command
from tests.conftest import namespaced_kafka
from tests.infra import Service, operator_login, script_output
from tests.test_faults import SESSIONS, TURNS, Pipeline, Stages, assert_exact, run_with_fault

pytestmark = pytest.mark.integration
BROKER = "2"
"""The node killed (any of the three: the cluster keeps two in sync)."""


CLUSTER_ENV = {"KAFKA_SASL": "1"}
"""As the deployments run Kafka (compose.ha.yaml): SCRAM logins and ACLs; the tests log in as its operator."""


def cluster(*args: str) -> str:
    return script_output("kafka-cluster.sh", *args, env=CLUSTER_ENV)


def sentinels(*args: str) -> str:
    return script_output("redis-sentinel.sh", *args)


@pytest.fixture(scope="module")
def cluster_broker() -> Iterator[Service]:
    cluster("reset")  # on empty storage, in the mode asked for (a formatted node keeps its own)
    cluster("start")
    yield Service(cluster("bootstrap"), "script", login=operator_login(CLUSTER_ENV, "kafka-cluster.sh"))
    cluster("reset")


@pytest.fixture(scope="module")
def sentinel_url() -> Iterator[str]:
    sentinels("reset")
    sentinels("start")
    yield sentinels("url")
    sentinels("reset")


@pytest.fixture
async def cluster_kafka(cluster_broker: Service, sentinel_url: str) -> KafkaConfig:
    namespace = f"test-{uuid.uuid4().hex[:12]}."
    kafka = namespaced_kafka(
        cluster_broker.address, sentinel_url, namespace, seal_keys_replicas=1, **cluster_broker.login
    )
    await create_topics(kafka, partitions=3)
    return kafka


def failover() -> str:
    """Kill the master; the new master's host:port once the Sentinels have promoted the replica."""
    before = sentinels("master")
    sentinels("kill-master")
    deadline = time.monotonic() + 30
    while (now := sentinels("master")) == before:
        assert time.monotonic() < deadline, "the Sentinels did not fail over"
        time.sleep(0.2)
    return now


async def test_topics_get_three_copies_and_need_two(cluster_kafka: KafkaConfig) -> None:
    states = await describe_topics(cluster_kafka)
    assert {s.replicas for s in states} == {3}
    assert {s.configs.get("min.insync.replicas") for s in states} == {"2"}


def test_sentinel_urls_name_the_group_and_refuse_what_is_not_one() -> None:
    target = sentinel_target("redis+sentinel://:pw@a:1,b/grp/2?sentinel_password=s")
    assert target is not None
    assert (target.sentinels, target.master, target.db) == ([("a", 1), ("b", 26379)], "grp", 2)
    assert (target.password, target.sentinel_password, target.sentinel_username) == ("pw", "s", None)
    named = sentinel_target("redis+sentinel://svc:pw@a:1/grp?sentinel_username=client&sentinel_password=s")
    assert named is not None and (named.username, named.sentinel_username) == ("svc", "client")
    assert sentinel_target("redis://a:1/0") is None
    for bad in (
        "redis+sentinel://a:1",
        "redis+sentinel:///grp",
        "redis+sentinel://a:x/grp",
        "redis+sentinel://a/g/x",
    ):
        with pytest.raises(ValueError):
            sentinel_target(bad)


async def test_both_clients_follow_a_failover(sentinel_url: str) -> None:
    # Issue 55, row 8: the Sentinels take ACL users only (the default user is off), as deployed.
    anonymous = redis_client(re.sub(r"//[^@]*@", "//", sentinel_url).split("?")[0])  # no user, no password
    with pytest.raises(Exception, match=r"(?i)auth"):
        await anonymous.ping()
    await anonymous.aclose()
    pipelined = PipelinedRedis(sentinel_url)
    plain = redis_client(sentinel_url)
    key = f"t-{uuid.uuid4().hex}".encode()
    assert await pipelined.send(command(b"INCR", key)) == 1
    assert await plain.incr(key) == 2
    assert int(await pipelined.send(command(b"WAIT", b"1", b"2000"))) == 1  # the replica has it
    await asyncio.to_thread(failover)
    for client_step in range(2):  # each client: a failure or two while it finds the new master, then on it
        deadline = time.monotonic() + 30
        while True:
            try:
                value = (
                    await pipelined.send(command(b"INCR", key)) if client_step == 0 else await plain.incr(key)
                )
                break
            except Exception:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.2)
        assert value == 3 + client_step  # nothing acknowledged by the replica was lost
    await pipelined.aclose()
    await plain.aclose()
    await asyncio.to_thread(sentinels, "restart-old")  # back as a replica, for the next test


@pytest.mark.parametrize("restarted", [False, True], ids=["left-dead", "restarted"])
def test_a_broker_and_the_redis_master_killed_in_the_middle_of_traffic_lose_nothing(
    restarted: bool, cluster_kafka: KafkaConfig, sentinel_url: str, smollm2_path: Path, tmp_path: Path
) -> None:
    """Once the traffic is under way, a broker is killed and the Redis master is killed (the Sentinels promote
    the replica); both stay dead to the end, or both are started again (the broker rejoins, the old master comes
    back as a replica) while traffic goes on."""
    pipe = Pipeline(
        cluster_kafka,
        sentinel_url,
        f"test-{uuid.uuid4().hex[:12]}:",
        str(smollm2_path),
        tmp_path / "rig",
        Stages(
            policy_latency_ms=250,
            judge_latency_ms=20,
            extra_env={"TURNSTREAM_KAFKA_SEAL_KEYS_REPLICAS": "1"},
        ),
    )

    def fault() -> None:
        cluster("kill", BROKER)
        failover()
        if restarted:
            time.sleep(2.0)
            cluster("start-node", BROKER)
            sentinels("restart-old")

    pipe.start()
    try:
        acc = run_with_fault(pipe, cluster_kafka, fault)
        assert_exact(acc, pipe)
        assert acc.found["samples"] == SESSIONS * (TURNS - 1) + len(acc.recorded_unanswered)
    finally:
        pipe.stop()
        if not restarted:
            cluster("start-node", BROKER)
            sentinels("restart-old")

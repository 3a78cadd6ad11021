"""Redis that fails over: a master, a replica and three Sentinels (scripts/redis-sentinel.sh), named to every service
by one ``redis+sentinel://`` URL. Both of turnstream's Redis clients (redis-py's and the proxy's pipelined one)
follow a failover; and the whole pipeline (the fault rig of tests/test_faults.py) goes on when the master is killed
in the middle of traffic, with every sealing key kept (``kafka.seal_keys_replicas`` 1: a key seals nothing before
the replica has it), so every record stays readable: every answered turn recorded once, every sample made once."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from runtime.messaging.topics import create_topics
from runtime.transport.redis_urls import redis_client, sentinel_target
from runtime.transport.resp import PipelinedRedis, command
from tests.conftest import namespaced_kafka
from tests.infra import Service, script_output
from tests.test_faults import SESSIONS, TURNS, Pipeline, Stages, assert_exact, run_with_fault

pytestmark = pytest.mark.integration


def sentinels(*args: str) -> str:
    return script_output("redis-sentinel.sh", *args)


@pytest.fixture(scope="module")
def sentinel_url() -> Iterator[str]:
    sentinels("reset")
    sentinels("start")
    yield sentinels("url")
    sentinels("reset")


def failover() -> str:
    """Kill the master; the new master's host:port once the Sentinels have promoted the replica."""
    before = sentinels("master")
    sentinels("kill-master")
    deadline = time.monotonic() + 30
    while (now := sentinels("master")) == before:
        assert time.monotonic() < deadline, "the Sentinels did not fail over"
        time.sleep(0.2)
    return now


def test_sentinel_urls_name_the_group_and_refuse_what_is_not_one() -> None:
    target = sentinel_target("redis+sentinel://:pw@a:1,b/grp/2?sentinel_password=s")
    assert target is not None
    assert (target.sentinels, target.master, target.db) == ([("a", 1), ("b", 26379)], "grp", 2)
    assert (target.password, target.sentinel_password) == ("pw", "s")
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
async def test_the_master_killed_in_the_middle_of_traffic_loses_nothing(
    restarted: bool, sentinel_url: str, kafka_service: Service, smollm2_path: Path, tmp_path: Path
) -> None:
    kafka = namespaced_kafka(
        kafka_service.address, sentinel_url, f"test-{uuid.uuid4().hex[:12]}.", seal_keys_replicas=1
    )
    await create_topics(kafka, partitions=3)
    pipe = Pipeline(
        kafka,
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
        failover()
        if restarted:
            time.sleep(2.0)
            sentinels("restart-old")

    await asyncio.to_thread(pipe.start)
    try:
        acc = await asyncio.to_thread(run_with_fault, pipe, kafka, fault)
        assert_exact(acc, pipe)
        assert acc.found["samples"] == SESSIONS * (TURNS - 1) + len(acc.recorded_unanswered)
    finally:
        await asyncio.to_thread(pipe.stop)
        if not restarted:
            await asyncio.to_thread(sentinels, "restart-old")

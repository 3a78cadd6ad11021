"""Fault injection: the whole pipeline (proxy, pairer, judge, teacher, dispatcher as real processes; real Kafka and
Redis; stub engines) under synthetic traffic, one fault at a time, then an account by turn id of everything it
produced (bench/pipeline_rig.py). Every answered turn must be recorded once and produce exactly its pairing,
judgments, teacher scores and sample: nothing lost, nothing twice.

Each test prints its account as one JSON line (``pytest -s tests/test_faults.py`` shows the table of expected vs
found per fault).
"""

from __future__ import annotations

import asyncio
import json
import re
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import httpx
import msgspec
import pytest

from runtime.configuration.config import KafkaConfig, RedisConfig
from runtime.messaging.topics import create_topics, group_lag
from runtime.process.ports import free_port
from tests.conftest import TEST_PARTITIONS
from tests.infra import REPO, Service, _script, moved_to

sys.path.insert(0, str(REPO / "bench"))

from pipeline_rig import (
    GROUPS,
    Account,
    Pipeline,
    Stages,
    account,
    drive,
    read_all,
)

pytestmark = pytest.mark.integration

SESSIONS, TURNS, CONCURRENCY = 10, 5, 4
PREFIX = "f"


def run_with_fault(
    pipe: Pipeline, kafka: KafkaConfig, fault: Callable[[], None] | None, after_turns: int = 12
) -> Account:
    """Drive the sessions; once ``after_turns`` turns are answered, inject ``fault`` (in a thread, while traffic
    goes on); then wait until every stage has caught up and account."""
    answered = 0
    injected = threading.Event()
    errors: list[BaseException] = []

    def inject() -> None:
        try:
            if fault is not None:
                fault()
        except BaseException as exc:  # reported by the test, not lost in a thread
            errors.append(exc)
        finally:
            injected.set()

    def progress() -> None:
        nonlocal answered
        answered += 1
        if answered == after_turns:
            threading.Thread(target=inject, daemon=True).start()

    driven = asyncio.run(drive(pipe.proxy_url, SESSIONS, TURNS, CONCURRENCY, PREFIX, progress=progress))
    assert injected.wait(120), "the fault was never injected"
    assert not errors, f"injecting the fault failed: {errors[0]!r}"
    acc = asyncio.run(settle(pipe, kafka, driven))
    print(json.dumps({"account": acc.summary(), "retries": driven.retries, "errors": dict(driven.errors)}))
    return acc


async def settle(pipe: Pipeline, kafka: KafkaConfig, driven: object, timeout_s: float = 180) -> Account:
    """Wait until nothing is missing and every consumer group has committed everything (then a late duplicate
    would already be on its topic), and account."""
    deadline = time.monotonic() + timeout_s
    while True:
        acc = account(await read_all(kafka), driven, PREFIX)  # type: ignore[arg-type]
        caught_up = not any(acc.missing.values()) and not any((await group_lag(kafka, GROUPS)).values())
        if caught_up or time.monotonic() > deadline:
            if caught_up:  # one more look after the last commits
                await asyncio.sleep(2)
                acc = account(await read_all(kafka), driven, PREFIX)  # type: ignore[arg-type]
            return acc
        await asyncio.sleep(1)


@pytest.fixture
def pipeline(
    kafka: KafkaConfig, redis_config: RedisConfig, smollm2_path: Path, tmp_path: Path
) -> Callable[..., Pipeline]:
    started: list[Pipeline] = []

    def make(
        kafka_config: KafkaConfig | None = None, redis_url: str | None = None, **stages: object
    ) -> Pipeline:
        pipe = Pipeline(
            kafka_config or kafka,
            redis_url or redis_config.url,
            redis_config.key_prefix,
            str(smollm2_path),
            tmp_path / "rig",
            Stages(**{"policy_latency_ms": 250, "judge_latency_ms": 20, **stages}),  # type: ignore[arg-type]
        )
        started.append(pipe)
        return pipe.start()

    yield make  # type: ignore[misc]
    for pipe in started:
        pipe.stop()


def assert_exact(acc: Account, pipe: Pipeline) -> None:
    logs = {p.name: p.read_text()[-3000:] for p in pipe.workdir.glob("*.log")} if not acc.exact else {}
    assert acc.exact, json.dumps(
        {"account": acc.summary(), "missing": acc.missing, "dup": acc.duplicated, "logs": logs}
    )


SERVICES = ("proxy", "pairer", "judge", "teacher", "dispatcher")


def test_kill_9_of_each_service_in_turn_in_the_middle_of_traffic(
    pipeline: Callable[..., Pipeline], kafka: KafkaConfig
) -> None:
    """Each of the five services ``kill -9``'d and started again, one after another, while the traffic goes on (the
    policy slow enough, 1.5 s a turn, that the users are still sending when the last kill comes), and engines slow
    enough (300 ms) that the judge and teacher hold work in flight when theirs comes: what each had read and not
    committed is read again after its restart (redelivered under the same keys). One rig for the five kills: a
    rig's start and settling cost more than its traffic."""
    pipe = pipeline(policy_latency_ms=1500, judge_latency_ms=300, teacher_latency_ms=300)
    killed: list[str] = []

    def fault() -> None:
        for service in SERVICES:
            pipe.kill(service)
            time.sleep(1.0)
            pipe.start_service(service)
            killed.append(service)

    acc = run_with_fault(pipe, kafka, fault, after_turns=6)
    assert killed == list(SERVICES)
    assert_exact(acc, pipe)
    assert acc.found["samples"] == SESSIONS * (TURNS - 1) + len(acc.recorded_unanswered)


def test_kafka_broker_restart(
    pipeline: Callable[..., Pipeline], kafka: KafkaConfig, private_kafka: Service
) -> None:
    """The broker stopped and started again under traffic: the module's own (``private_kafka``), so that every
    other test goes on with the run's shared one."""
    own = moved_to(kafka, private_kafka)
    asyncio.run(create_topics(own, partitions=TEST_PARTITIONS))
    pipe = pipeline(kafka_config=own)

    def fault() -> None:
        _script("kafka.sh", "stop", private_kafka.script_env)
        time.sleep(3.0)  # the proxy keeps answering; turns wait in its spool
        _script("kafka.sh", "start", private_kafka.script_env)

    acc = run_with_fault(pipe, own, fault)
    assert_exact(acc, pipe)


def test_kafka_unreachable_at_the_proxy(pipeline: Callable[..., Pipeline], kafka: KafkaConfig) -> None:
    """A partition between the proxy and Kafka (the rest of the pipeline still reaches it): the proxy is
    restarted pointing at an address where no broker answers, serves traffic into its spool, and is restarted
    once more with the broker reachable; the spool (turns of an earlier run) drains in order."""
    pipe = pipeline()

    def fault() -> None:
        pipe.stop_service("proxy")
        pipe.start_service("proxy", {"TURNSTREAM_KAFKA_BOOTSTRAP": f"127.0.0.1:{free_port()}"})
        deadline = time.monotonic() + 60
        while httpx.get(pipe.proxy_url + "/healthz", timeout=5).json()["spool_pending"] == 0:
            assert time.monotonic() < deadline, "turns served during the partition wait in the spool"
            time.sleep(0.2)
        pipe.stop_service("proxy")
        pipe.start_service("proxy")

    acc = run_with_fault(pipe, kafka, fault)
    assert_exact(acc, pipe)


def test_redis_restart(pipeline: Callable[..., Pipeline], kafka: KafkaConfig, private_redis: Service) -> None:
    """Redis stopped and started again under traffic: the module's own (``private_redis``), holding the sealing
    keys and the proxy's state, so that every other test goes on with the run's shared one."""
    own = msgspec.structs.replace(kafka, seal_keys_url=private_redis.address)
    pipe = pipeline(kafka_config=own, redis_url=private_redis.address)

    def fault() -> None:
        _script("redis.sh", "stop", private_redis.script_env)
        time.sleep(2.0)
        _script("redis.sh", "start", private_redis.script_env)

    acc = run_with_fault(pipe, own, fault)
    assert_exact(acc, pipe)
    metrics = httpx.get(pipe.proxy_url + "/metrics", timeout=5).text
    late = float(re.search(r"^turnstream_proxy_turns_numbered_late_total (\S+)$", metrics, re.M).group(1))  # type: ignore[union-attr]
    assert late > 0, "the outage happened while the proxy served: some turns were numbered when published"


def test_engine_errors_and_timeouts_at_a_configured_rate(
    pipeline: Callable[..., Pipeline], kafka: KafkaConfig
) -> None:
    """Every 7th policy call fails (the user sees 502 and retries), every 5th judge and teacher call fails (the
    workers retry), and every 9th policy call outlasts the proxy's engine timeout (504, retried)."""
    pipe = pipeline(
        policy_fail_every=7,
        judge_fail_every=5,
        teacher_fail_every=5,
        policy_slow_every=9,
        extra_env={"TURNSTREAM_ENGINE_TIMEOUT_S": "0.5"},
    )
    acc = run_with_fault(pipe, kafka, None)
    assert_exact(acc, pipe)


def test_malformed_records_on_every_topic_go_to_deadletter_and_the_pipeline_goes_on(
    pipeline: Callable[..., Pipeline], kafka: KafkaConfig
) -> None:
    """Garbage bytes, a valid event of the wrong type, and an event that breaks the contract, on each topic a
    stage consumes: every consuming group dead-letters each of them (with its coordinates) and traffic flows."""
    import msgspec

    from runtime.messaging.bus import EventProducer, read_topic
    from schemas import encode
    from schemas.topics import DEADLETTER, JUDGMENTS, TEACHER, TURNS, TURNS_PAIRED
    from tests.strategies import example_turn

    pipe = pipeline()
    broken_turn = msgspec.msgpack.encode({**msgspec.to_builtins(example_turn("x", 1)), "turn_id": "x:7"})
    wrong_type = encode(example_turn("x", 1))  # a Turn where another event belongs
    bad = {
        TURNS: [b"\x00garbage", broken_turn],
        TURNS_PAIRED: [b"\x00garbage", wrong_type],
        JUDGMENTS: [b"\x00garbage", wrong_type],
        TEACHER: [b"\x00garbage", wrong_type],
    }

    async def publish() -> None:
        async with EventProducer(kafka) as producer:
            for spec, values in bad.items():
                for value in values:
                    await (await producer.send_raw_nowait(spec.name(kafka.namespace), value, b"x"))

    asyncio.run(publish())
    acc = run_with_fault(pipe, kafka, None)
    assert_exact(acc, pipe)

    async def letters() -> list[tuple[str, str]]:
        return [(r.event.source_topic, r.event.consumer_group) async for r in read_topic(kafka, DEADLETTER)]

    found = Counter(asyncio.run(letters()))
    groups = {
        TURNS: ["turnstream-pairer"],
        TURNS_PAIRED: ["turnstream-judge-rig"],
        JUDGMENTS: ["turnstream-teacher", "turnstream-dispatcher"],
        TEACHER: ["turnstream-dispatcher"],
    }
    expected = Counter(
        {(spec.name(kafka.namespace), g): len(bad[spec]) for spec, gs in groups.items() for g in gs}
    )
    assert found == expected

"""The Kafka users of runtime/security/kafka_users.py against a real broker run as the deployments run it (SCRAM
logins, ``StandardAuthorizer``, nothing allowed without an ACL): ``turnstream kafka-users apply`` makes them; each
service's user writes exactly the topics it produces, reads the ones it consumes, joins only its own group; a
wrong password fails at once with the broker's reason instead of waiting out ``connect_wait_s``."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import msgspec
import pytest
from aiokafka.errors import (
    ClusterAuthorizationFailedError,
    GroupAuthorizationFailedError,
    TopicAuthorizationFailedError,
)

from runtime.configuration.config import Config, KafkaConfig
from runtime.messaging.acls import Acl, Op, Pattern, Resource, create_acls, describe_acls
from runtime.messaging.bus import EventConsumer, EventProducer, KafkaLoginRefused, read_topic
from runtime.messaging.topics import _admin, create_topics, describe_topics, group_lag
from runtime.security.kafka_users import USERS, acls, apply, principal
from schemas.topics import ALL_TOPICS, DEADLETTER, JUDGMENTS, SAMPLES, TURNS, TURNS_PAIRED, TopicSpec
from tests.infra import Service, start_private_kafka

PASSWORDS = {name: f"pw-{name}-{uuid.uuid4().hex[:8]}" for name in USERS}


@pytest.fixture(scope="module")
def sasl_broker() -> Iterator[tuple[Service, str]]:
    service = start_private_kafka()
    try:
        yield service, service.login["sasl_password"]
    finally:
        service.stop()


def login(
    broker: tuple[Service, str], user: str, password: str, namespace: str, **settings: object
) -> KafkaConfig:
    return msgspec.convert(
        {
            "bootstrap": broker[0].address,
            "namespace": namespace,
            "security_protocol": "SASL_PLAINTEXT",
            "sasl_mechanism": "SCRAM-SHA-512",
            "sasl_username": user,
            "sasl_password": password,
            "seal": False,
            "connect_wait_s": 30.0,
            "poll_timeout_ms": 200,
            "session_timeout_ms": 6000,
            "heartbeat_interval_ms": 500,
            **settings,
        },
        KafkaConfig,
    )


@pytest.fixture
async def deployed(sasl_broker: tuple[Service, str]) -> AsyncIterator[Config]:
    """A namespace of this test's own, its topics made and every service's user applied, as the operator."""
    ns = f"k-{uuid.uuid4().hex[:8]}."
    config = Config(kafka=login(sasl_broker, "admin", sasl_broker[1], ns))
    await create_topics(config.kafka, partitions=1)
    assert await apply(config, PASSWORDS) == sum(len(acls(s, config)) for s in USERS)
    yield config


def as_user(config: Config, user: str) -> KafkaConfig:
    return msgspec.structs.replace(config.kafka, sasl_username=user, sasl_password=PASSWORDS[user])


async def writes(kafka: KafkaConfig, spec: TopicSpec) -> bool:
    """Whether ``kafka``'s user may write ``spec`` (a user that may write no topic cannot start a producer)."""
    producer = EventProducer(kafka)
    try:
        await producer.start()
    except ClusterAuthorizationFailedError:
        await producer.stop()
        return False
    async with producer:
        try:
            await producer.send_raw(spec.name(kafka.namespace), b"{}", b"k")
            return True
        except TopicAuthorizationFailedError:
            return False


async def reads(kafka: KafkaConfig, spec: TopicSpec) -> bool:
    try:
        return len([r async for r in read_topic(kafka, spec, timeout_s=10, skip_undecodable=True)]) >= 0
    except TopicAuthorizationFailedError:
        return False


async def test_each_service_writes_and_reads_exactly_its_own_topics(deployed: Config) -> None:
    """The whole table, tried: every user against every topic, writing and reading. A worker's password cannot
    write ``samples`` or ``weights`` (training or publishing past the pipeline), and only the services that consume a
    conversation topic can read it (each topic holds a record first: an empty one reads as empty to anyone)."""
    for spec in ALL_TOPICS:
        assert await writes(deployed.kafka, spec)
    found: dict[str, tuple[set[str], set[str]]] = {}
    for user, grant in USERS.items():
        kafka = as_user(deployed, user)
        wrote = {t.base for t in ALL_TOPICS if await writes(kafka, t)}
        read = {t.base for t in ALL_TOPICS if await reads(kafka, t)}
        found[user] = (wrote, read)
        assert wrote == {t.base for t in grant.writes}, user
        assert read == {t.base for t in grant.reads}, user
    assert "samples" not in found["judge"][0] and "weights" not in found["dispatcher"][0]
    assert "turns" not in found["judge"][1] and "turns" in found["console"][1]


async def test_a_service_joins_its_own_group_and_no_other(deployed: Config) -> None:
    """The pairer consumes in its group, dead-letters a record it cannot use and commits past it; the judge's
    password cannot join the pairer's group (and take its partitions); any judge id's group is the judge's."""
    ns = deployed.kafka.namespace
    async with EventProducer(as_user(deployed, "proxy")) as proxy:
        await proxy.send_raw(TURNS.name(ns), b"not a turn", b"s1")
    pairer = EventConsumer(as_user(deployed, "pairer"), [TURNS], deployed.pairer.group_id)
    await pairer.start()

    async def dead_lettered() -> None:
        if [r async for r in read_topic(deployed.kafka, DEADLETTER, timeout_s=1)]:
            pairer.request_stop()

    async def handle(batch: list[Any]) -> None:
        raise AssertionError(f"a record that is no turn was handed on: {batch}")

    await asyncio.wait_for(pairer.run(handle, idle=dead_lettered), 60)
    assert await group_lag(deployed.kafka, {deployed.pairer.group_id: (TURNS,)}) == {
        deployed.pairer.group_id: 0
    }
    judge = as_user(deployed, "judge")
    intruder = EventConsumer(judge, [TURNS_PAIRED], deployed.pairer.group_id)
    await intruder.start()
    with pytest.raises(GroupAuthorizationFailedError):  # it stops with the reason: retrying would not mend it
        await asyncio.wait_for(intruder.run(handle), 30)
    await intruder.stop()
    alt = EventConsumer(judge, [TURNS_PAIRED], "turnstream-judge-alt")
    await alt.start()

    async def joined() -> None:
        if alt.assignment():
            alt.request_stop()

    await asyncio.wait_for(alt.run(handle, idle=joined), 30)


async def test_apply_again_changes_nothing_and_removes_what_the_table_no_longer_grants(
    deployed: Config, sasl_broker: tuple[Service, str]
) -> None:
    """Rerun (compose's topics step at every ``up``): nothing changes. A grant the table does not make (one an
    operator added by hand, or one a newer version dropped) is removed in this namespace; the same user's grants in
    another namespace are left alone."""
    admin = _admin(deployed.kafka)
    await admin.start()
    try:
        ns = deployed.kafka.namespace
        extra = Acl(principal("judge"), Resource.TOPIC, SAMPLES.name(ns), Pattern.LITERAL, Op.WRITE)
        elsewhere = Acl(principal("judge"), Resource.TOPIC, "other.samples", Pattern.LITERAL, Op.WRITE)
        await create_acls(admin, [extra, elsewhere])
        assert await apply(deployed, PASSWORDS) == 1
        assert await apply(deployed, PASSWORDS) == 0
        left = set(await describe_acls(admin, principal("judge")))
        assert elsewhere in left and extra not in left
        assert not await writes(as_user(deployed, "judge"), SAMPLES)
    finally:
        await admin.close()


async def test_a_wrong_password_fails_at_once_with_the_brokers_reason(deployed: Config) -> None:
    """aiokafka reports a refused login as a broker it could not reach; without the check a service retried a wrong
    password for ``connect_wait_s`` (300 s by default) and said the broker was unreachable."""
    wrong = msgspec.structs.replace(as_user(deployed, "judge"), sasl_password="not-the-password")
    started = time.monotonic()
    with pytest.raises(KafkaLoginRefused, match=r"'judge'.*(?i:authentication)"):
        async with EventProducer(wrong):
            pass
    assert time.monotonic() - started < 10  # connect_wait_s is 30


async def test_only_the_operator_makes_and_reconfigures_topics(deployed: Config) -> None:
    """Topics are the operator's: a service's password cannot make one (auto-creation included) or change its
    retention; ``turnstream topics create`` as ``admin`` finds all of them made."""
    other = deployed.kafka.in_namespace(f"k-{uuid.uuid4().hex[:8]}.")
    trainer = msgspec.structs.replace(other, sasl_username="trainer", sasl_password=PASSWORDS["trainer"])
    with pytest.raises(RuntimeError, match="Kafka error code 29"):  # TOPIC_AUTHORIZATION_FAILED
        await asyncio.wait_for(create_topics(trainer, partitions=1), 40)
    states = await describe_topics(deployed.kafka)
    assert {s.status for s in states} == {"exists"}


async def test_turnstream_run_gives_each_service_a_kafka_user_of_its_own_and_removes_them(
    deployed: Config,
) -> None:
    """``turnstream run`` on a broker that takes SASL logins (scripts/kafka.sh starts its own so): each service it
    starts logs in as a user made for the run, with its service's ACLs; services without Kafka get none; the stop
    removes the users (a removed user's login is refused) and their ACLs."""
    from runtime.process.supervisor import Service as Process
    from services.run.own_users import give_own_kafka_users, remove_kafka_users

    services = [Process(n, [n], {"KEEP": "1"}, 0, "/metrics", 2) for n in ("judge", "dispatcher", "simulate")]
    given, logins = await give_own_kafka_users(deployed, services)
    env = {s.name: s.env for s in given}
    assert env["simulate"] == {"KEEP": "1"} and len(logins) == 2
    judge = msgspec.structs.replace(
        deployed.kafka,
        sasl_username=env["judge"]["TURNSTREAM_KAFKA_SASL_USERNAME"],
        sasl_password=env["judge"]["TURNSTREAM_KAFKA_SASL_PASSWORD"],
    )
    assert judge.sasl_username.startswith("run-") and judge.sasl_username.endswith("-judge")
    assert await writes(judge, JUDGMENTS) and not await writes(judge, SAMPLES)
    await remove_kafka_users(deployed, logins)
    admin = _admin(deployed.kafka)
    await admin.start()
    try:
        assert [a for login in logins for a in await describe_acls(admin, principal(login))] == []
    finally:
        await admin.close()
    with pytest.raises(KafkaLoginRefused):
        async with EventProducer(judge):
            pass

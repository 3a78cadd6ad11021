"""Create and describe turnstream's topics (``turnstream topics create|describe``). Creation is idempotent."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from aiokafka.errors import TopicAlreadyExistsError

from runtime.configuration.config import Config, KafkaConfig
from runtime.messaging.bus import _security
from schemas import ALL_TOPICS, TopicSpec
from schemas.modes import mode_spec
from schemas.topics import JUDGMENTS, SESSIONS_ENDED, TEACHER, TURNS, TURNS_PAIRED

_TOPIC_ALREADY_EXISTS = 36


class TopicState(msgspec.Struct):
    name: str
    status: str
    """``created``, ``exists`` or ``missing``."""
    partitions: int | None = None
    configs: dict[str, str] = msgspec.field(default_factory=dict)
    replicas: int | None = None
    """Copies of each partition (the first partition's replica list)."""


def _admin(kafka: KafkaConfig) -> AIOKafkaAdminClient:
    return AIOKafkaAdminClient(
        bootstrap_servers=kafka.bootstrap,
        client_id=f"{kafka.client_id}-admin",
        request_timeout_ms=kafka.request_timeout_ms,
        **_security(kafka),
    )


async def create_topics(
    kafka: KafkaConfig,
    specs: tuple[TopicSpec, ...] = ALL_TOPICS,
    *,
    partitions: int | None = None,
) -> list[TopicState]:
    """Create every topic of ``kafka.namespace`` that does not exist yet, and give existing ones the retention
    ``kafka.retention_days`` asks for (``updated``). ``partitions`` overrides the specs' counts (the compacted
    ``weights`` topic keeps one partition: its single key orders all versions). New topics are replicated as the
    cluster allows (``KafkaConfig.replication``: 3 copies and ``min.insync.replicas`` 2 on three brokers or more,
    the broker count read from the cluster); an existing topic keeps its replication."""
    retention = kafka.retention_ms()
    admin = _admin(kafka)
    await admin.start()
    try:
        brokers = len((await admin.describe_cluster()).get("brokers") or ()) or 1
        replication_factor, insync = kafka.replication(brokers)
        existing = set(await admin.list_topics())
        new: list[NewTopic] = []
        states: list[TopicState] = []
        for spec in specs:
            name = spec.name(kafka.namespace)
            configs = {**spec.configs(retention.get(spec.base)), "min.insync.replicas": str(insync)}
            if name in existing:
                states.append(TopicState(name, "exists"))
                if spec.base in retention:
                    await _set_retention(admin, states[-1], retention[spec.base])
                continue
            count = spec.partitions if partitions is None or spec.compacted else partitions
            new.append(NewTopic(name, count, replication_factor, topic_configs=configs))
            states.append(TopicState(name, "created", count, configs, replication_factor))
        if new:
            try:
                resp = await admin.create_topics(new)
                errors = getattr(resp, "topic_errors", None) or getattr(resp, "topic_error_codes", [])
                for err in errors:
                    name, code = err[0], err[1]
                    if code == _TOPIC_ALREADY_EXISTS:
                        _mark(states, name, "exists")
                    elif code != 0:
                        raise RuntimeError(
                            f"creating topic {name} failed with Kafka error code {code}: {err}"
                        )
            except TopicAlreadyExistsError:
                pass  # a concurrent creator won the race; the topics exist either way
        await _wait_visible(admin, [s.name for s in states])
        return states
    finally:
        await admin.close()


_TOPIC_CONFIG = 1
"""DescribeConfigs' ``config_source`` of a value set on the topic itself (DYNAMIC_TOPIC_CONFIG)."""


async def _set_retention(admin: AIOKafkaAdminClient, state: TopicState, retention_ms: int) -> None:
    """Give an existing topic ``retention_ms``. Kafka's AlterConfigs (the only kind aiokafka sends) replaces every
    value set on the topic, so the values set there now go with it unchanged."""
    current = await _topic_configs(admin, state.name)
    if current.get("retention.ms") == str(retention_ms):
        return
    wanted = {**current, "retention.ms": str(retention_ms)}
    (altered,) = await admin.alter_configs([ConfigResource(ConfigResourceType.TOPIC, state.name, wanted)])
    for res in altered.resources:
        if res[0] != 0:  # (error_code, error_message, resource_type, resource_name)
            raise RuntimeError(f"setting retention.ms of {state.name} failed: Kafka error {res[0]} {res[1]}")
    await _wait_config(admin, state.name, "retention.ms", str(retention_ms))
    state.status = "updated"
    state.configs = {"retention.ms": str(retention_ms)}


async def _topic_configs(admin: AIOKafkaAdminClient, name: str) -> dict[str, str]:
    """The values set on the topic itself (not the broker's defaults)."""
    (resp,) = await admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, name)])
    current: dict[str, str] = {}
    for res in resp.resources:
        for entry in res[4]:  # (name, value, read_only, config_source, is_sensitive, ...)
            if entry[3] == _TOPIC_CONFIG and entry[1] is not None:
                current[entry[0]] = entry[1]
    return current


async def _wait_config(
    admin: AIOKafkaAdminClient, name: str, key: str, value: str, timeout_s: float = 30.0
) -> None:
    """Until a broker describes the topic with ``key=value``. Under KRaft the controller acknowledges an
    AlterConfigs once it is in the metadata log, before the broker answering DescribeConfigs has applied it: a
    ``describe`` right after ``updated`` showed the old retention (seen once in CI)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while (await _topic_configs(admin, name)).get(key) != value:
        if asyncio.get_running_loop().time() > deadline:
            raise TimeoutError(f"{name}: {key}={value} not visible after {timeout_s} s")
        await asyncio.sleep(0.1)


def _mark(states: list[TopicState], name: str, status: str) -> None:
    for s in states:
        if s.name == name:
            s.status = status


async def _wait_visible(admin: AIOKafkaAdminClient, names: list[str], timeout_s: float = 30.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        described = await admin.describe_topics(names)
        if all(d.get("error_code", 0) == 0 and d.get("partitions") for d in described):
            return
        if asyncio.get_running_loop().time() > deadline:
            raise TimeoutError(f"topics not visible after {timeout_s} s: {names}")
        await asyncio.sleep(0.2)


async def list_topic_names(kafka: KafkaConfig) -> list[str]:
    """Every topic on the cluster, of every namespace."""
    admin = _admin(kafka)
    await admin.start()
    try:
        return sorted(await admin.list_topics())
    finally:
        await admin.close()


async def describe_topics(kafka: KafkaConfig, specs: tuple[TopicSpec, ...] = ALL_TOPICS) -> list[TopicState]:
    admin = _admin(kafka)
    await admin.start()
    try:
        existing = set(await admin.list_topics())
        names = [s.name(kafka.namespace) for s in specs]
        present = [n for n in names if n in existing]
        partitions: dict[str, int] = {}
        replicas: dict[str, int] = {}
        configs: dict[str, dict[str, str]] = {n: {} for n in present}
        if present:
            for d in await admin.describe_topics(present):
                parts = d.get("partitions") or []
                partitions[d["topic"]] = len(parts)
                if parts:
                    replicas[d["topic"]] = len(parts[0].get("replicas") or ())
            configs.update(await _describe_configs(admin, present))
        return [
            TopicState(n, "exists", partitions.get(n), configs.get(n, {}), replicas.get(n))
            if n in existing
            else TopicState(n, "missing")
            for n in names
        ]
    finally:
        await admin.close()


async def _describe_configs(admin: AIOKafkaAdminClient, names: list[str]) -> dict[str, dict[str, str]]:
    wanted = {"retention.ms", "cleanup.policy", "max.message.bytes", "min.insync.replicas"}
    out: dict[str, dict[str, str]] = {}
    responses: Any = await admin.describe_configs(
        [ConfigResource(ConfigResourceType.TOPIC, n) for n in names]
    )
    for resp in responses:
        for resource in resp.resources:
            # (error_code, error_message, resource_type, resource_name, config_entries)
            name, entries = resource[3], resource[4]
            out[name] = {e[0]: e[1] for e in entries if e[0] in wanted}
    return out


def pipeline_groups(config: Config) -> dict[str, tuple[TopicSpec, ...]]:
    """The consumer groups that carry a turn from ``turns`` to ``samples``, and the topics each reads (the
    trainer's offsets live in its checkpoints, so it is not among them)."""
    groups = {
        config.pairer.group_id: (TURNS, SESSIONS_ENDED),
        config.judge.group_id: (TURNS_PAIRED,),
        config.dispatcher.group_id: (JUDGMENTS, TEACHER),
    }
    if mode_spec(config.dispatcher.mode).needs_hint:  # the teacher scores accepted hints
        groups[config.teacher.group_id] = (JUDGMENTS,)
    return groups


async def group_lag(kafka: KafkaConfig, groups: dict[str, tuple[TopicSpec, ...]]) -> dict[str, int]:
    """Records each consumer group (in ``kafka.namespace``) has yet to commit, over all partitions of its topics:
    0 means it has finished everything written so far. A group that never committed owes every record kept."""
    from runtime.messaging.bus import consumer_group, kafka_consumer, topic_partitions

    admin = _admin(kafka)
    # End offsets as the broker's high watermark (what every record written so far makes), as before.
    reader = kafka_consumer(kafka, client_id=f"{kafka.client_id}-lag", isolation_level="read_uncommitted")
    await admin.start()
    await reader.start()
    try:
        lag: dict[str, int] = {}
        for group, specs in groups.items():
            tps = [tp for spec in specs for tp in await topic_partitions(reader, spec.name(kafka.namespace))]
            end = await reader.end_offsets(tps)
            start = await reader.beginning_offsets(tps)
            done = await admin.list_consumer_group_offsets(consumer_group(kafka, group), partitions=tps)
            total = 0
            for tp in tps:
                committed = done[tp].offset if tp in done and done[tp].offset >= 0 else start[tp]
                total += max(end[tp] - max(committed, start[tp]), 0)
            lag[group] = total
        return lag
    finally:
        await reader.stop()
        await admin.close()

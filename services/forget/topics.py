"""The topics' side of forgetting: which sessions a user had, and what is left of sessions on every topic of every
namespace, read record by record (a proof reads everything: slow on a large cluster, and meant to be)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import msgspec
from aiokafka.structs import ConsumerRecord

from runtime.configuration.config import KafkaConfig
from runtime.messaging.bus import kafka_consumer, topic_partitions
from runtime.messaging.topics import list_topic_names
from runtime.security.erasure.envelope import is_sealed
from runtime.security.erasure.sealing import open_value
from schemas import ALL_TOPICS, DecodeError, TopicSpec, Turn, decode
from schemas.topics import TURNS


class TopicProof(msgspec.Struct):
    topic: str
    readable: int = 0
    """Records of the sessions that still open: 0 once their keys are gone."""
    sealed: int = 0
    """Records of the sessions left on the log, sealed under a destroyed key: noise until retention drops them."""
    clear: int = 0
    """Records of the sessions written in the clear (``kafka.seal`` off then): they cannot be erased here."""


def private_topics(names: list[str], namespaces: list[str] | None = None) -> list[tuple[str, TopicSpec]]:
    """The topics among ``names`` that hold conversations: in ``namespaces`` (``""`` the live one), or in any."""
    out = []
    for name in sorted(names):
        for spec in ALL_TOPICS:
            if not spec.private:
                continue
            if namespaces is None:
                found = name == spec.base or name.endswith("." + spec.base)
            else:
                found = any(name == spec.name(ns) for ns in namespaces)
            if found:
                out.append((name, spec))
    return out


async def raw_records(kafka: KafkaConfig, topic: str) -> AsyncIterator[ConsumerRecord[bytes, bytes]]:
    """Every record of ``topic`` up to its end as of the call, as stored."""
    consumer = kafka_consumer(kafka, client_id=f"{kafka.client_id}-forget")
    await consumer.start()
    try:
        tps = await topic_partitions(consumer, topic)
        consumer.assign(tps)
        start, end = await consumer.beginning_offsets(tps), await consumer.end_offsets(tps)
        for tp in tps:
            consumer.seek(tp, start[tp])
        remaining = {tp for tp in tps if start[tp] < end[tp]}
        while remaining:
            for tp, records in (await consumer.getmany(*remaining, timeout_ms=1000)).items():
                for rec in records:
                    if rec.offset < end[tp]:
                        yield rec
                if await consumer.position(tp) >= end[tp]:
                    remaining.discard(tp)
    finally:
        await consumer.stop()


async def sessions_of_user(kafka: KafkaConfig, user: str, namespaces: list[str] | None) -> set[str]:
    """The sessions whose turns name ``user`` (``Turn.user``: with per-user proxy keys, the key's user), in the
    namespaces' ``turns`` (None: every namespace's)."""
    found: set[str] = set()
    for name, spec in private_topics(await list_topic_names(kafka), namespaces):
        if spec is not TURNS:
            continue
        async for rec in raw_records(kafka, name):
            try:
                value = await open_value(kafka, name, rec.key, rec.value or b"")
                if value is not None and (turn := decode(value, Turn)).user == user:
                    found.add(turn.session_id)
            except DecodeError:
                continue
    return found


async def what_is_left(
    kafka: KafkaConfig, sessions: set[str], namespaces: list[str] | None
) -> list[TopicProof]:
    """Per topic that holds conversations, in the namespaces (None: all): the sessions' records, by what can be
    read."""
    keys = {s.encode() for s in sessions}
    proofs = []
    for name, _ in private_topics(await list_topic_names(kafka), namespaces):
        proof = TopicProof(name)
        async for rec in raw_records(kafka, name):
            if rec.key not in keys:
                continue
            value = rec.value or b""
            if not is_sealed(value):
                proof.clear += 1
                continue
            try:
                opened = await open_value(kafka, name, rec.key, value)
            except DecodeError:
                opened = None
            if opened is None:
                proof.sealed += 1
            else:
                proof.readable += 1
        proofs.append(proof)
    return proofs

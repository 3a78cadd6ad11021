"""Sealing at the bus: values of the topics that hold conversations (``TopicSpec.private``) are sealed under their
session's key (the record key) on the way out and opened on the way in.

The keys live at ``kafka.seal_keys_url`` (a Redis URL, ``redis.url`` unless set; empty: records go in the clear).
A value written in the clear (sealing off, or before it existed) reads as it is, so a topic may hold both. A sealed
value whose key is gone belongs to a forgotten session: readers skip it and count it
(``turnstream_bus_forgotten_total``), never dead-letter it.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Iterable

from runtime.configuration.config import KafkaConfig
from runtime.observability.metrics import FORGOTTEN
from runtime.security.erasure.envelope import Unreadable, is_sealed, key_id, seal, sealed_key_id, unseal
from runtime.security.erasure.keys import SessionForgotten, SessionKeys
from runtime.transport.resp import PipelinedRedis
from schemas import DecodeError, TopicSpec

_stores: weakref.WeakKeyDictionary[
    asyncio.AbstractEventLoop, dict[tuple[str, str, float, int], SessionKeys]
] = weakref.WeakKeyDictionary()


def session_keys(kafka: KafkaConfig) -> SessionKeys | None:
    """This event loop's key store for ``kafka``'s settings (one Redis connection per loop and URL); None when
    sealing is off."""
    if not (kafka.seal and kafka.seal_keys_url):
        return None
    per_loop = _stores.setdefault(asyncio.get_running_loop(), {})
    where = (kafka.seal_keys_url, kafka.seal_keys_prefix, kafka.seal_keys_cache_s, kafka.seal_keys_replicas)
    store = per_loop.get(where)
    if store is None:
        store = per_loop[where] = SessionKeys(
            PipelinedRedis(kafka.seal_keys_url),
            kafka.seal_keys_prefix,
            cache_ttl_s=kafka.seal_keys_cache_s,
            replicas=kafka.seal_keys_replicas,
        )
    return store


async def seal_value(kafka: KafkaConfig, spec: TopicSpec, key: bytes | None, value: bytes) -> bytes:
    """``value`` as it goes to ``spec``'s topic under record ``key``: sealed when the topic is private, sealing is
    on and the record has a key (its session); else as it is. ``SessionForgotten`` for a fenced session's record:
    the writer drops it, counted (``turnstream_bus_forgotten_total``)."""
    store = session_keys(kafka) if spec.private and key else None
    if store is None or key is None:
        return value
    session = key.decode("utf-8", "surrogateescape")
    return seal(await store.for_writing(session), session, value)


async def prefetch_keys(kafka: KafkaConfig, spec: TopicSpec, keys: Iterable[bytes | None]) -> None:
    """Make or fetch the keys a batch for ``spec`` will be sealed under, all at once: one pipelined burst to Redis
    instead of a round trip per new session as each record is sealed (a fenced session's record then finds out
    when it is sealed)."""
    store = session_keys(kafka) if spec.private else None
    if store is not None:
        sessions = {k.decode("utf-8", "surrogateescape") for k in keys if k}
        for result in await asyncio.gather(*(store.for_writing(s) for s in sessions), return_exceptions=True):
            if isinstance(result, BaseException) and not isinstance(result, SessionForgotten):
                raise result


async def open_value(kafka: KafkaConfig, topic: str, key: bytes | None, value: bytes) -> bytes | None:
    """The plain bytes of a value read from ``topic``; None for a forgotten session's (its key, or the key it was
    sealed under, destroyed; counted). A sealed value that does not open, or that cannot be opened here (sealing
    off), is a ``DecodeError``."""
    if not is_sealed(value):
        return value
    store = session_keys(kafka)
    if store is None or key is None:
        raise DecodeError(
            "decode", f"a sealed record on {topic}, and no key store here (kafka.seal_keys_url)"
        )
    session = key.decode("utf-8", "surrogateescape")
    data_key = await store.for_reading(session)
    if data_key is None or key_id(data_key) != sealed_key_id(value):  # the key it was sealed under is gone
        FORGOTTEN.labels(topic).inc()
        return None
    try:
        return unseal(data_key, session, value)
    except Unreadable as exc:
        raise DecodeError("decode", f"a sealed record of session {session!r}: {exc}") from None


async def forgotten_session(kafka: KafkaConfig, key: bytes | None, value: bytes) -> str | None:
    """The session a record belongs to when it was skipped because that session was forgotten; else None (it was
    in the clear, or opened, or dead-lettered)."""
    store = session_keys(kafka)
    if store is None or key is None or not is_sealed(value):
        return None
    session = key.decode("utf-8", "surrogateescape")
    data_key = await store.for_reading(session)
    return session if data_key is None or key_id(data_key) != sealed_key_id(value) else None

"""Typed Kafka I/O for every service: an idempotent producer and a batch consumer with manual commits.

Delivery is at-least-once, made effectively-once downstream by stable ids: offsets are committed only after the
handler returned (its work is durable) and after undecodable records went to ``deadletter``. One bad record
never stops a consumer: a batch that keeps failing for a reason other than the infrastructure (``transient``) is
handled one record at a time, and the record that fails alone goes to ``deadletter``. No record is produced
that Kafka would refuse (``RecordTooLarge``), and a dead letter always fits.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, Generic, Literal, TypeVar

import redis.exceptions
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRebalanceListener, TopicPartition
from aiokafka.errors import (
    ClusterAuthorizationFailedError,
    GroupAuthorizationFailedError,
    IllegalStateError,
    InvalidProducerEpoch,
    InvalidProducerIdMapping,
    KafkaConnectionError,
    KafkaError,
    KafkaTimeoutError,
    OutOfOrderSequenceNumber,
    TopicAuthorizationFailedError,
    UnknownProducerId,
)
from aiokafka.structs import ConsumerRecord, OffsetAndMetadata, RecordMetadata

from runtime.configuration.config import KafkaConfig
from runtime.observability.metrics import (
    CONSUMED,
    DEADLETTERED,
    FORGOTTEN,
    HANDLER_ERRORS,
    LAG,
    PRODUCED,
    PRODUCERS_RENEWED,
)
from runtime.security.erasure.envelope import is_sealed
from runtime.security.erasure.keys import SessionForgotten
from runtime.security.erasure.sealing import open_value, seal_value
from schemas import DeadLetter, DecodeError, Event, TopicSpec, decode, encode
from schemas.topics import DEADLETTER, MAX_MESSAGE_BYTES, RECORD_OVERHEAD_BYTES

log = logging.getLogger("turnstream.bus")

E = TypeVar("E", bound=Event)
StartFrom = Literal["earliest", "latest"]
"""Where a group without committed offsets starts; a group with them always resumes from them."""


class Record(Generic[E]):
    """A decoded event with its Kafka coordinates."""

    __slots__ = ("event", "key", "offset", "partition", "timestamp_ms", "topic")

    def __init__(
        self, event: E, topic: str, partition: int, offset: int, key: bytes | None, timestamp_ms: int
    ):
        self.event = event
        self.topic = topic
        self.partition = partition
        self.offset = offset
        self.key = key
        self.timestamp_ms = timestamp_ms

    def __repr__(self) -> str:
        return f"Record({type(self.event).__name__} {self.topic}[{self.partition}]@{self.offset})"


def _security(kafka: KafkaConfig) -> dict[str, Any]:
    """aiokafka's connection settings for ``kafka.security_protocol``: TLS needs an SSL context (aiokafka refuses
    SSL without one), SASL its mechanism and credentials."""
    opts: dict[str, Any] = {"security_protocol": kafka.security_protocol}
    if kafka.security_protocol in ("SSL", "SASL_SSL"):
        from aiokafka.helpers import create_ssl_context

        opts["ssl_context"] = create_ssl_context(
            cafile=kafka.ssl_cafile, certfile=kafka.ssl_certfile, keyfile=kafka.ssl_keyfile
        )
    if kafka.sasl_mechanism:
        opts.update(
            sasl_mechanism=kafka.sasl_mechanism,
            sasl_plain_username=kafka.sasl_username,
            sasl_plain_password=kafka.sasl_password,
        )
    return opts


class KafkaLoginRefused(ConnectionError):
    """The brokers refused this client's SASL user or password: waiting would not help (aiokafka reports it as a
    broker it could not reach)."""


async def login_refused(kafka: KafkaConfig) -> str | None:
    """Why the brokers refuse ``kafka``'s login, or None (no SASL, or no broker said so). One connection per
    bootstrap server, made only after a client could not start: aiokafka logs the refusal and raises
    ``KafkaConnectionError``, the same error as for a broker that is down."""
    if not kafka.sasl_mechanism:
        return None
    from aiokafka.conn import create_conn
    from aiokafka.errors import IllegalSaslStateError, SaslAuthenticationFailed, UnsupportedSaslMechanismError

    for server in kafka.bootstrap.split(","):
        host, _, port = server.strip().rpartition(":")
        try:
            conn = await create_conn(
                host.strip("[]"), int(port), request_timeout_ms=10_000, **_security(kafka)
            )
        except (SaslAuthenticationFailed, UnsupportedSaslMechanismError, IllegalSaslStateError) as exc:
            return str(exc)
        except Exception:  # unreachable, or any other trouble: the caller's retry handles it
            continue
        conn.close()
    return None


class RecordTooLarge(ValueError):
    """A record Kafka would refuse (``MAX_MESSAGE_BYTES``): raised before sending, so it never reaches aiokafka's
    retry loop. Not ``transient``: sending it again cannot succeed."""


MAX_VALUE_BYTES = MAX_MESSAGE_BYTES - RECORD_OVERHEAD_BYTES
"""The largest record value (and key) turnstream sends."""


def transient(exc: BaseException) -> bool:
    """Whether a failure is the infrastructure's (a broker, Redis or an engine unreachable or slow: retried until
    it passes) rather than the record's own (retried a few times, then the record is dead-lettered). An exception
    may say so itself with a ``transient`` attribute."""
    marked = getattr(exc, "transient", None)
    if isinstance(marked, bool):
        return marked
    if isinstance(exc, RecordTooLarge):
        return False
    if isinstance(exc, KafkaError):
        return bool(exc.retriable) or isinstance(exc, KafkaConnectionError | KafkaTimeoutError)
    if isinstance(exc, redis.exceptions.ConnectionError | redis.exceptions.TimeoutError):
        return True
    return isinstance(exc, ConnectionError | TimeoutError | OSError)


def _key_bytes(key: str | bytes | None) -> bytes | None:
    return key.encode() if isinstance(key, str) else key


C = TypeVar("C", AIOKafkaProducer, AIOKafkaConsumer)


async def _start_retrying(make: Callable[[], C], kafka: KafkaConfig, wait_s: float | None, what: str) -> C:
    """A started aiokafka client from ``make``; while the broker is unreachable, retry with a fresh one (a client
    whose start failed is not restartable) until ``wait_s`` has passed. Other errors (TLS, a refused login or
    authorization) fail at once."""
    wait = kafka.connect_wait_s if wait_s is None else wait_s
    deadline = time.monotonic() + wait
    backoff = 0.5
    while True:
        client = make()
        try:
            await client.start()
            return client
        except KafkaConnectionError as exc:
            with contextlib.suppress(Exception):
                await client.stop()
            if refused := await login_refused(kafka):
                raise KafkaLoginRefused(
                    f"Kafka refused {what}'s login as {kafka.sasl_username!r} ({kafka.sasl_mechanism}): {refused}"
                ) from exc
            left = deadline - time.monotonic()
            if left <= 0:
                raise
            log.warning(
                "Kafka unreachable; retrying",
                extra={
                    "client": what,
                    "bootstrap": kafka.bootstrap,
                    "error": str(exc),
                    "gives_up_in_s": round(left),
                },
            )
            await asyncio.sleep(min(backoff, left))
            backoff = min(backoff * 2, 5.0)


REFUSED = (TopicAuthorizationFailedError, GroupAuthorizationFailedError, ClusterAuthorizationFailedError)
"""The brokers' ACLs forbid what this client asked: a deployment's mistake that no retry mends, so it stops the
service with the broker's reason (``runtime/security/kafka_users.py`` declares what each service may do)."""

_RENEW_ON = (OutOfOrderSequenceNumber, UnknownProducerId, InvalidProducerEpoch, InvalidProducerIdMapping)
"""Send errors after which an idempotent producer cannot go on: the broker lost (or fenced) its state."""


def producer_options(kafka: KafkaConfig, client_id: str) -> dict[str, Any]:
    """aiokafka producer settings for turnstream's records: idempotent, acks=all, room for the largest record."""
    return dict(
        bootstrap_servers=kafka.bootstrap,
        client_id=client_id,
        acks="all",
        enable_idempotence=True,
        max_request_size=MAX_MESSAGE_BYTES,
        request_timeout_ms=kafka.request_timeout_ms,
        linger_ms=5,
        **_security(kafka),
    )


class EventProducer:
    """Idempotent, acks=all producer of contract events."""

    def __init__(self, kafka: KafkaConfig, *, client_id: str | None = None):
        self.kafka = kafka
        self._options: dict[str, Any] = producer_options(kafka, client_id or kafka.client_id)
        self._producer = self._make()
        self._stale = False
        self._renewing = asyncio.Lock()

    def _make(self) -> AIOKafkaProducer:
        return AIOKafkaProducer(**self._options)

    async def start(self, wait_s: float | None = None) -> None:
        """Connect, retrying an unreachable broker for ``wait_s`` (default ``kafka.connect_wait_s``)."""
        unstarted = self._producer
        try:
            self._producer = await _start_retrying(self._make, self.kafka, wait_s, "producer")
        finally:
            await unstarted.stop()  # never started: only releases what its constructor set up

    async def stop(self) -> None:
        await self._producer.stop()

    async def __aenter__(self) -> EventProducer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def topic(self, spec: TopicSpec) -> str:
        return spec.name(self.kafka.namespace)

    def _check(self, spec: TopicSpec, event: Event) -> None:
        if not isinstance(event, spec.event_type):
            raise TypeError(
                f"topic {spec.base!r} carries {spec.event_type.__name__}, not {type(event).__name__}"
            )

    async def send(self, spec: TopicSpec, event: Event, key: str | bytes | None) -> RecordMetadata | None:
        """Produce one event and wait until the broker acknowledged it (all in-sync replicas). None: the record's
        session was forgotten and is fenced, so it was not written (counted)."""
        fut = await self.send_nowait(spec, event, key)
        return await fut

    async def send_nowait(
        self, spec: TopicSpec, event: Event, key: str | bytes | None
    ) -> asyncio.Future[Any]:
        """Queue one event; the returned future resolves when it is acknowledged (at once, to None, for a fenced
        session's record, which is not written). For batching."""
        self._check(spec, event)
        key_bytes = _key_bytes(key)
        try:
            value = await seal_value(self.kafka, spec, key_bytes, encode(event))
        except SessionForgotten:
            FORGOTTEN.labels(self.topic(spec)).inc()
            skipped: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            skipped.set_result(None)
            return skipped
        return await self.send_raw_nowait(self.topic(spec), value, key_bytes)

    async def send_raw(self, topic: str, value: bytes, key: bytes | None = None) -> RecordMetadata:
        """Produce bytes as they are (tests, tools that copy records between namespaces)."""
        return await (await self.send_raw_nowait(topic, value, key))

    async def send_raw_nowait(
        self, topic: str, value: bytes, key: bytes | None = None
    ) -> asyncio.Future[Any]:
        """Queue already-encoded bytes (e.g. from a durable spool); the future resolves on acknowledgement."""
        if len(value) + len(key or b"") > MAX_VALUE_BYTES:
            raise RecordTooLarge(
                f"a record of {len(value) + len(key or b'')} bytes for {topic} exceeds the limit of "
                f"{MAX_VALUE_BYTES} bytes (Kafka's {MAX_MESSAGE_BYTES} less framing)"
            )
        if self._stale:
            await self._renew()
        fut: asyncio.Future[Any] = await self._producer.send(topic, value, key=key)

        def done(f: asyncio.Future[Any]) -> None:
            if f.cancelled():
                return
            exc = f.exception()
            if exc is None:
                PRODUCED.labels(topic).inc()
            elif isinstance(exc, _RENEW_ON) and not self._stale:
                self._stale = True
                log.warning(
                    "producer state lost by the broker; renewing the producer", extra={"error": repr(exc)}
                )

        fut.add_done_callback(done)
        return fut

    async def _renew(self) -> None:
        """A fresh producer (new producer id) in place of one whose idempotence state the broker no longer
        accepts (after a broker restart aiokafka keeps failing with OutOfOrderSequenceNumber otherwise). The
        records that failed are retried by their callers; a resend is a redelivery under the same keys."""
        async with self._renewing:
            if not self._stale:
                return
            old = self._producer
            self._producer = await _start_retrying(self._make, self.kafka, None, "producer")
            self._stale = False
            PRODUCERS_RENEWED.inc()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(old.stop(), 10)

    async def flush(self) -> None:
        await self._producer.flush()


Handler = Callable[[list[Record[Any]]], Awaitable[None]]


class _Rebalance(ConsumerRebalanceListener):  # type: ignore[misc]
    """Before partitions are taken away, let the in-flight batch finish and commit."""

    def __init__(self, owner: EventConsumer) -> None:
        self.owner = owner

    async def on_partitions_revoked(self, revoked: Sequence[TopicPartition]) -> None:
        async with self.owner._work_lock:
            pass

    async def on_partitions_assigned(self, assigned: Sequence[TopicPartition]) -> None:
        self.owner.assignment_changes += 1
        log.info("partitions assigned", extra={"group": self.owner.group_id, "partitions": len(assigned)})


def kafka_consumer(
    kafka: KafkaConfig, *, client_id: str, group_id: str | None = None, **options: Any
) -> AIOKafkaConsumer:
    """Every Kafka consumer turnstream makes, with what they all need: the broker and its security, fetch sizes
    that fit the largest record, the configured timeouts, committed records only, no auto-commit, from the
    earliest record. ``group_id`` is the full group name (``consumer_group``); ``options`` override the rest."""
    settings: dict[str, Any] = dict(
        bootstrap_servers=kafka.bootstrap,
        client_id=client_id,
        group_id=group_id,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        isolation_level="read_committed",
        max_partition_fetch_bytes=MAX_MESSAGE_BYTES,
        fetch_max_bytes=4 * MAX_MESSAGE_BYTES,
        session_timeout_ms=kafka.session_timeout_ms,
        heartbeat_interval_ms=kafka.heartbeat_interval_ms,
        request_timeout_ms=kafka.request_timeout_ms,
        **_security(kafka),
    )
    return AIOKafkaConsumer(**(settings | options))


def consumer_group(kafka: KafkaConfig, group_id: str) -> str:
    """The Kafka group id for ``group_id`` in ``kafka.namespace``: a replay's consumers must never join (and so
    rebalance, or share offsets with) the live pipeline's groups."""
    return kafka.namespace + group_id if kafka.namespace else group_id


class EventConsumer:
    """Batch consumer of contract events with manual commits and dead-lettering.

    ``run(handler)`` polls batches, decodes them (bad records go to ``deadletter`` with their coordinates),
    awaits ``handler`` on the good ones, then commits. A failing handler is retried from the same offsets with
    backoff: for as long as the failure is ``transient``, otherwise ``attempts`` times, after which the batch is
    handled one record at a time and a record that still fails is dead-lettered (``processing``), so its
    partition moves on. ``request_stop()`` (wired to SIGTERM/SIGINT by ``install_signal_handlers``) lets the
    in-flight batch finish and commit before the consumer leaves its group.

    ``group=False`` reads every partition without a consumer group (no heartbeats, nothing committed, starting
    from ``start_from`` each time): for followers such as the weight reloader, where every process must see every
    record. ``fetch_max_wait_ms`` is how long the broker holds an empty fetch (records still return at once),
    ``poll_timeout_ms`` how long a poll waits and ``background_poll_ms`` how often aiokafka's fetch routine wakes
    without news: followers of rare records raise all three and cost almost nothing idle.
    """

    def __init__(
        self,
        kafka: KafkaConfig,
        specs: Sequence[TopicSpec],
        group_id: str,
        *,
        start_from: StartFrom = "earliest",
        isolation_level: Literal["read_committed", "read_uncommitted"] = "read_committed",
        max_batch: int | None = None,
        deadletter: EventProducer | None = None,
        client_id: str | None = None,
        group: bool = True,
        fetch_max_wait_ms: int = 500,
        poll_timeout_ms: int | None = None,
        background_poll_ms: int = 200,
        attempts: int = 3,
    ) -> None:
        self.kafka = kafka
        self.attempts = attempts
        self._strikes = 0
        """Failures in a row, not transient, of the batch at the same offsets."""
        self.group_id = group_id
        self.group = group
        self.poll_timeout_ms = poll_timeout_ms or kafka.poll_timeout_ms
        self.specs = {spec.name(kafka.namespace): spec for spec in specs}
        self.max_batch = max_batch or kafka.max_batch
        self._own_deadletter = deadletter is None
        self._deadletter = deadletter or EventProducer(kafka, client_id=f"{group_id}-deadletter")
        self._options: dict[str, Any] = dict(
            client_id=client_id or kafka.client_id,
            group_id=consumer_group(kafka, group_id) if group else None,
            fetch_max_wait_ms=fetch_max_wait_ms,
            consumer_timeout_ms=background_poll_ms,
            auto_offset_reset="latest" if start_from == "latest" else "earliest",
            isolation_level=isolation_level,
        )
        self._consumer = self._make()
        self._work_lock = asyncio.Lock()
        self._stop = asyncio.Event()
        self._started = False
        self.assignment_changes = 0

    # lifecycle ------------------------------------------------------------------------------------------------

    async def start(self) -> None:
        if self._own_deadletter:
            await self._deadletter.start()
        unstarted = self._consumer
        self._consumer = await _start_retrying(self._make, self.kafka, None, f"consumer {self.group_id}")
        await unstarted.stop()  # never started: only releases what its constructor set up
        if self.group:
            self._consumer.subscribe(list(self.specs), listener=_Rebalance(self))
        else:
            self._consumer.subscribe(list(self.specs))
        self._started = True

    def _make(self) -> AIOKafkaConsumer:
        return kafka_consumer(self.kafka, **self._options)

    async def stop(self) -> None:
        """Leave the group (after any in-flight batch committed) and close connections."""
        self._stop.set()
        async with self._work_lock:
            if self._started:
                self._started = False
                await self._consumer.stop()
                if self._own_deadletter:
                    await self._deadletter.stop()

    async def __aenter__(self) -> EventConsumer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def request_stop(self) -> None:
        self._stop.set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig)

    def remove_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)

    def _on_signal(self, sig: signal.Signals) -> None:
        log.info("signal received: finishing the in-flight batch, then stopping", extra={"signal": sig.name})
        self.request_stop()

    def assignment(self) -> set[TopicPartition]:
        return set(self._consumer.assignment())

    async def behind(self) -> bool:
        """Whether the log already holds records past this consumer's position on any assigned partition (a
        backlog, a replay). Unknown (no fetch answered yet) counts as behind."""
        for tp in self._consumer.assignment():
            highwater = self._consumer.highwater(tp)
            if highwater is None or await self._consumer.position(tp) < highwater:
                return True
        return False

    # consumption ----------------------------------------------------------------------------------------------

    async def run(self, handler: Handler, *, idle: Callable[[], Awaitable[None]] | None = None) -> None:
        """Consume until ``request_stop()``. ``idle`` (optional) runs after every poll, batch or not."""
        backoff = 0.5
        while not self._stop.is_set():
            try:
                batch = await self._consumer.getmany(
                    timeout_ms=self.poll_timeout_ms, max_records=self.max_batch
                )
            except REFUSED as exc:
                log.error("Kafka refused this consumer", extra={"group": self.group_id, "error": repr(exc)})
                raise
            except KafkaError as exc:
                log.warning("poll failed, retrying", extra={"error": repr(exc)})
                await asyncio.sleep(backoff)
                continue
            if batch:
                async with self._work_lock:
                    try:
                        if self._strikes >= self.attempts:
                            await self._one_by_one(batch, handler)
                        else:
                            await self._process(batch, handler)
                        backoff = 0.5
                        self._strikes = 0
                    except Exception as exc:
                        HANDLER_ERRORS.labels(self.group_id).inc()
                        if not transient(exc):
                            self._strikes += 1
                        log.exception(
                            "batch failed; retrying it from its first unhandled offsets",
                            extra={"error": repr(exc), "attempt": self._strikes},
                        )
                        if not isinstance(exc, _Rewound):
                            self._rewind(batch)
                        await self._sleep_unless_stopped(backoff)
                        backoff = min(backoff * 2, 30.0)
            if idle is not None:
                try:
                    await idle()
                except Exception as exc:  # periodic work (the pairer's sweep): the next round tries again
                    HANDLER_ERRORS.labels(self.group_id).inc()
                    log.warning("idle work failed; it runs again next round", extra={"error": repr(exc)})
                    await self._sleep_unless_stopped(backoff)
        await self.stop()

    async def _sleep_unless_stopped(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stop.wait(), seconds)

    async def _one_by_one(
        self, batch: dict[TopicPartition, list[ConsumerRecord[bytes, bytes]]], handler: Handler
    ) -> None:
        """A batch that failed ``attempts`` times, one record at a time: the one that fails alone (not
        transiently) is dead-lettered and passed; a transient failure rewinds to the first record not done."""
        left = {tp: list(records) for tp, records in batch.items()}
        for tp, records in batch.items():
            for rec in records:
                try:
                    await self._process({tp: [rec]}, handler)
                except Exception as exc:
                    if transient(exc):
                        self._rewind({t: r for t, r in left.items() if r})
                        raise _Rewound(exc) from exc
                    HANDLER_ERRORS.labels(self.group_id).inc()
                    await dead_letter_record(
                        self._deadletter, rec, "processing", f"{type(exc).__name__}: {exc}", self.group_id
                    )
                    if self.group:
                        await self._consumer.commit({tp: OffsetAndMetadata(rec.offset + 1, "")})
                    CONSUMED.labels(tp.topic, self.group_id).inc()
                left[tp].pop(0)

    def _rewind(self, batch: dict[TopicPartition, list[ConsumerRecord[bytes, bytes]]]) -> None:
        for tp, records in batch.items():
            with contextlib.suppress(IllegalStateError, AssertionError):
                self._consumer.seek(tp, records[0].offset)

    async def _process(
        self, batch: dict[TopicPartition, list[ConsumerRecord[bytes, bytes]]], handler: Handler
    ) -> None:
        good: list[Record[Any]] = []
        for tp, records in batch.items():
            spec = self.specs[tp.topic]
            for rec in records:
                decoded = await decode_or_dead_letter(rec, spec.event_type, self._deadletter, self.group_id)
                if decoded is not None:
                    good.append(decoded)
        if good:
            await handler(good)
        for tp, records in batch.items():
            CONSUMED.labels(tp.topic, self.group_id).inc(len(records))
        offsets = {tp: OffsetAndMetadata(records[-1].offset + 1, "") for tp, records in batch.items()}
        if self.group:
            await self._consumer.commit(offsets)
        for tp, om in offsets.items():
            hw = self._consumer.highwater(tp)
            if hw is not None:
                LAG.labels(tp.topic, str(tp.partition), self.group_id).set(max(hw - om.offset, 0))

    async def dead_letter(self, record: Record[Any], error: str, kind: str = "processing") -> None:
        """For handlers: send a decoded record the service cannot use to ``deadletter``. Durable on return."""
        await send_dead_letter(
            self._deadletter,
            record.topic,
            record.partition,
            record.offset,
            record.key,
            record.timestamp_ms,
            encode(record.event),
            kind,
            error,
            self.group_id,
        )


class _Rewound(Exception):
    """A transient failure in ``_one_by_one``, which already rewound each partition to its first record not
    done."""

    transient = True


DEAD_LETTER_ERROR_CHARS = 4096
"""An error message longer than this is cut (a message can quote the record it failed on)."""


async def send_dead_letter(
    producer: EventProducer,
    topic: str,
    partition: int,
    offset: int,
    key: bytes | None,
    timestamp_ms: int | None,
    payload: bytes,
    kind: str,
    error: str,
    group: str,
) -> None:
    """Keep a record a consumer cannot use on ``deadletter`` (durable on return), counted and logged. A payload
    that would not fit beside the letter's own fields is left out (its size and SHA-256 kept): the letter must
    always fit, or the partition it came from could never move on."""
    import hashlib

    error = (error or "unknown error")[:DEAD_LETTER_ERROR_CHARS]
    key = key if key is None or len(key) <= 1024 else key[:1024]
    omitted, digest = 0, ""
    if len(payload) + len(error) + len(topic) + len(group) + 2 * len(key or b"") + 1024 > MAX_VALUE_BYTES:
        omitted, digest, payload = len(payload), hashlib.sha256(payload).hexdigest(), b""
    letter = DeadLetter(
        source_topic=topic,
        source_partition=partition,
        source_offset=offset,
        source_key=key,
        source_timestamp_ms=timestamp_ms,
        error_kind=kind,
        error=error,
        consumer_group=group,
        payload=payload,
        created_at=time.time(),
        payload_omitted_bytes=omitted,
        payload_sha256=digest,
    )
    await producer.send(DEADLETTER, letter, key if key is not None else b"")
    DEADLETTERED.labels(topic, group, kind).inc()
    log.warning(
        "record dead-lettered",
        extra={"topic": topic, "partition": partition, "offset": offset, "kind": kind, "error": error},
    )


async def decode_or_dead_letter(
    rec: ConsumerRecord[bytes, bytes], event_type: type[E], deadletter: EventProducer, group: str
) -> Record[E] | None:
    """A received record decoded as ``event_type`` (opened first when sealed); or None once it is kept, verbatim,
    on ``deadletter`` (durable on return, so the caller may pass its offset), or when its session was forgotten
    (counted). The one decode path of every consumer."""
    try:
        value = await open_value(deadletter.kafka, rec.topic, rec.key, rec.value or b"")
        if value is None:
            return None
        event = decode(value, event_type)
    except DecodeError as exc:
        await dead_letter_record(deadletter, rec, exc.kind, str(exc), group)
        return None
    return Record(event, rec.topic, rec.partition, rec.offset, rec.key, rec.timestamp)


async def dead_letter_record(
    producer: EventProducer, rec: ConsumerRecord[bytes, bytes], kind: str, error: str, group: str
) -> None:
    """``send_dead_letter`` for a raw record as the consumer received it: opened when sealed and it opens (the
    letter is sealed under the same session's key, so the payload is as protected and tools can read it)."""
    payload = rec.value or b""
    if is_sealed(payload):
        with contextlib.suppress(DecodeError):
            payload = await open_value(producer.kafka, rec.topic, rec.key, payload) or payload
    await send_dead_letter(
        producer,
        rec.topic,
        rec.partition,
        rec.offset,
        rec.key,
        rec.timestamp,
        payload,
        kind,
        error,
        group,
    )


async def stop_when(event: asyncio.Event, consumer: EventConsumer) -> None:
    """Stop ``consumer`` (after its in-flight batch) once ``event`` is set: for services run in-process."""
    await event.wait()
    consumer.request_stop()


async def serve(
    consumer: EventConsumer,
    handler: Handler,
    *,
    idle: Callable[[], Awaitable[None]] | None = None,
    install_signals: bool = True,
    stop: asyncio.Event | None = None,
) -> None:
    """A consuming service's main loop: join the group and run ``handler`` until SIGTERM/SIGINT (when
    ``install_signals``) or ``stop`` is set; the in-flight batch finishes and is committed first."""
    await consumer.start()
    if install_signals:
        consumer.install_signal_handlers()
    watcher = asyncio.create_task(stop_when(stop, consumer)) if stop is not None else None
    try:
        await consumer.run(handler, idle=idle)
    finally:
        if watcher is not None:
            watcher.cancel()


async def topic_partitions(consumer: AIOKafkaConsumer, topic: str, attempts: int = 5) -> list[TopicPartition]:
    """Every partition of ``topic``, asking the broker when the consumer's metadata does not know it yet. A broker
    under load may answer a metadata request without brokers (aiokafka: "No broker metadata found in
    MetadataResponse -- ignoring", seen once in a full test run): asked again, a second apart, before the topic
    is declared missing."""
    partitions = consumer.partitions_for_topic(topic)
    for attempt in range(attempts):
        if partitions:
            break
        if attempt:
            await asyncio.sleep(1.0)
        await consumer._client.force_metadata_update()
        partitions = consumer.partitions_for_topic(topic)
    if not partitions:
        raise KeyError(f"topic {topic!r} does not exist")
    return [TopicPartition(topic, p) for p in sorted(partitions)]


async def read_topic(
    kafka: KafkaConfig,
    spec: TopicSpec,
    *,
    since_ms: int | None = None,
    isolation_level: Literal["read_committed", "read_uncommitted"] = "read_committed",
    timeout_s: float = 30.0,
    skip_undecodable: bool = False,
) -> AsyncIterator[Record[Any]]:
    """Replay a topic of ``kafka.namespace`` from the beginning, or from the first record at or after
    ``since_ms``, up to its end as of the call. No consumer group, no commits: replays never disturb live
    consumers. Undecodable records raise DecodeError (a replay should not silently skip history), unless
    ``skip_undecodable`` (an audit of a topic someone wrote garbage to: the consumers dead-lettered it)."""
    topic = spec.name(kafka.namespace)
    consumer = kafka_consumer(kafka, client_id=f"{kafka.client_id}-replay", isolation_level=isolation_level)
    await consumer.start()
    try:
        tps = await topic_partitions(consumer, topic)
        consumer.assign(tps)
        end = await consumer.end_offsets(tps)
        # Explicit seeks (not seek_to_beginning, whose reset races the first position() call).
        if since_ms is None:
            start = await consumer.beginning_offsets(tps)
        else:
            found = await consumer.offsets_for_times({tp: since_ms for tp in tps})
            start = {tp: found[tp].offset if found.get(tp) is not None else end[tp] for tp in tps}
        for tp in tps:
            consumer.seek(tp, start[tp])
        remaining = {tp for tp in tps if start[tp] < end[tp]}
        deadline = time.monotonic() + timeout_s
        while remaining:
            if time.monotonic() > deadline:
                raise TimeoutError(f"replay of {topic} did not reach the end offsets within {timeout_s} s")
            batch = await consumer.getmany(*remaining, timeout_ms=500)
            for tp, records in batch.items():
                for rec in records:
                    if rec.offset >= end[tp]:
                        break
                    try:
                        value = await open_value(kafka, rec.topic, rec.key, rec.value or b"")
                        if value is None:  # a forgotten session's
                            continue
                        event = decode(value, spec.event_type)
                    except DecodeError:
                        if skip_undecodable:
                            continue
                        raise
                    yield Record(
                        event,
                        rec.topic,
                        rec.partition,
                        rec.offset,
                        rec.key,
                        rec.timestamp,
                    )
            for tp in list(remaining):
                if await consumer.position(tp) >= end[tp]:
                    remaining.discard(tp)
    finally:
        await consumer.stop()

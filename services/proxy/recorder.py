"""Records turns without ever touching the user's response path.

``record()`` hands the turn to the spool file at once (a page-cache write, no fsync: a killed proxy loses no turn
it answered). A writer task fsyncs what gathered during ``linger_s`` in one go (in a worker thread), and a
publisher task sends fsync'd turns to Kafka in order, advancing the spool's cursor only after the broker
acknowledged them. If the write fails (disk full), turns wait in memory, in order, and the writer retries.
While Kafka is unreachable turns accumulate in the spool and go out, in order, once it is back; turn ids are
stable, so a resend is recognisable downstream.

Turns served while Redis is unreachable are recorded *unnumbered* (with a nonce) and numbered by the publisher as
it sends them (``number_once``, idempotent per nonce). Numbering at publish time follows spool order, so while any
unnumbered turn waits (or a backlog of an earlier run is unsent), ``deferring`` tells the proxy to record new
turns unnumbered too: a session's turns keep their order.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import struct
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path

import msgspec
from prometheus_client import Counter, Gauge

from runtime.configuration.config import KafkaConfig
from runtime.messaging.bus import EventProducer
from runtime.observability.metrics import FORGOTTEN
from runtime.security.erasure.keys import SessionForgotten
from runtime.security.erasure.sealing import prefetch_keys, seal_value
from schemas import SessionEnded, Turn, decode, encode
from schemas.topics import MAX_TURN_BYTES, SESSIONS_ENDED, TURNS
from services.proxy.spool import Spool
from services.proxy.turns import DROPPED, UnrecordableTurn

log = logging.getLogger("turnstream.proxy.recorder")

RECORDED = Counter("turnstream_proxy_turns_recorded_total", "Turns written to the spool and fsync'd")
PUBLISHED = Counter("turnstream_proxy_turns_published_total", "Turns acknowledged by Kafka")
PUBLISH_FAILURES = Counter(
    "turnstream_proxy_publish_failures_total", "Failed attempts to publish spooled turns"
)
SPOOLED = Gauge("turnstream_proxy_spool_pending", "Turns in the spool not yet acknowledged by Kafka")
SPOOL_BYTES = Gauge(
    "turnstream_proxy_spool_bytes", "Bytes in the spool (and in memory) not yet acknowledged by Kafka"
)
SPOOL_FULL = Gauge(
    "turnstream_proxy_spool_full",
    "1 while the spool is at proxy.spool_max_bytes or cannot be written: main turns are refused (503) or served "
    "unrecorded (proxy.spool_full)",
)

NUMBERED_LATE = Counter(
    "turnstream_proxy_turns_numbered_late_total",
    "Turns numbered when published (served while Redis was unreachable, or queued behind such turns)",
)

_KEY_LEN = struct.Struct("<H")
_UNNUMBERED = (
    0x8000  # flag in the key length (keys are session ids, at most 256 bytes): a nonce follows the key
)
_SESSION_END = 0x4000
"""Flag in the key length: the value is a ``SessionEnded`` for ``sessions.ended``, not a turn."""
_NONCE_LEN = 16


def _pack(key: bytes, value: bytes, nonce: bytes | None = None, session_end: bool = False) -> bytes:
    flags = _SESSION_END if session_end else 0
    if nonce is None:
        return _KEY_LEN.pack(len(key) | flags) + key + value
    return _KEY_LEN.pack(len(key) | _UNNUMBERED | flags) + key + nonce + value


def _unpack(record: bytes) -> tuple[bytes, bytes, bytes | None, bool]:
    """(key, value, nonce of an unnumbered turn or None, whether it is a session end)."""
    (n,) = _KEY_LEN.unpack_from(record)
    session_end = bool(n & _SESSION_END)
    n &= ~_SESSION_END
    if not n & _UNNUMBERED:
        return record[2 : 2 + n], record[2 + n :], None, session_end
    n &= ~_UNNUMBERED
    nonce_end = 2 + n + _NONCE_LEN
    return record[2 : 2 + n], record[nonce_end:], record[2 + n : nonce_end], session_end


def _key_of(record: bytes) -> bytes:
    """A spooled record's key (its session id), without copying its value."""
    (n,) = _KEY_LEN.unpack_from(record)
    return record[2 : 2 + (n & ~_SESSION_END & ~_UNNUMBERED)]


NumberOnce = Callable[[str, bytes], Awaitable[int]]


class TurnRecorder:
    def __init__(
        self,
        kafka: KafkaConfig,
        spool_dir: str | Path,
        batch: int = 256,
        linger_s: float = 0.05,
        number_once: NumberOnce | None = None,
        max_bytes: int = 0,
        when_full: str = "refuse",
        stop_write_timeout_s: float = 30.0,
    ) -> None:
        self.kafka = kafka
        self.max_bytes = max_bytes
        """The spool's cap (``proxy.spool_max_bytes``); 0: half the free space of its filesystem at start."""
        self.when_full = when_full
        """``refuse``: the proxy answers main turns 503 while full (it asks ``full``); ``serve``: they are served and
        ``record`` drops them, counted."""
        self.stop_write_timeout_s = stop_write_timeout_s
        self._buffer_bytes = 0
        self._was_full = False
        self.number_once = number_once
        """Numbers an unnumbered turn at publish time (``TurnNumbers.number_once``)."""
        self._unnumbered = 0
        """Unnumbered turns recorded in this run and not numbered yet."""
        self._backlog = 0
        """Records of an earlier run still to publish: they may be unnumbered, so new turns wait behind them."""
        self._numbers: dict[bytes, int] = {}
        self.spool_dir = Path(spool_dir)
        self.batch = batch
        self.linger_s = linger_s
        """How long the writer lets turns gather before one fsync takes them all (the user never waits on it)."""
        self.spool: Spool | None = None
        self._buffer: list[bytes] = []
        self._wrote = asyncio.Event()
        self._buffered = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._producer: EventProducer | None = None
        self._closing = False

    async def start(self) -> None:
        self.spool = await asyncio.to_thread(Spool, self.spool_dir)
        if not self.max_bytes:
            self.max_bytes = max(shutil.disk_usage(self.spool_dir).free // 2, 1)
        log.info("spool ready", extra={"dir": str(self.spool_dir), "max_bytes": self.max_bytes})
        SPOOLED.set(self.spool.pending)
        self._backlog = self.spool.pending
        if self.spool.pending:
            log.info(
                "spool holds unpublished turns from a previous run", extra={"pending": self.spool.pending}
            )
            self._wrote.set()
        self._tasks = [asyncio.create_task(self._writer()), asyncio.create_task(self._publisher())]

    @property
    def deferring(self) -> bool:
        """Whether new turns must be recorded unnumbered (to be numbered in spool order when published)."""
        return self._unnumbered > 0 or self._backlog > 0

    @property
    def full(self) -> bool:
        """At the cap, or unable to write (turns already wait in memory): take no more main turns. Says so, once
        per episode, in the log and ``turnstream_proxy_spool_full``."""
        spool = self.spool
        full = bool(self._buffer) or (
            spool is not None and spool.unpublished_bytes + self._buffer_bytes >= self.max_bytes
        )
        if full != self._was_full:
            self._was_full = full
            SPOOL_FULL.set(int(full))
            if full:
                log.warning(
                    "the spool is full: main turns are "
                    + ("refused (503)" if self.when_full == "refuse" else "served unrecorded")
                    + " until Kafka takes what it holds",
                    extra={"max_bytes": self.max_bytes, "in_memory": len(self._buffer)},
                )
            else:
                log.info("the spool has room again")
        return full

    def record(self, turn: Turn, *, unnumbered: bool = False) -> None:
        """Write a turn to the spool file. Never raises on the caller's path; never waits for a disk flush.
        An ``unnumbered`` turn's index and id are placeholders, replaced when it is published. Raises
        ``UnrecordableTurn`` for a turn whose record would exceed ``MAX_TURN_BYTES`` (see there why), or when the
        spool is full and full spools serve turns unrecorded (``proxy.spool_full = "serve"``)."""
        if self.when_full == "serve" and self.full:
            raise UnrecordableTurn("spool_full", "the spool is full; the turn was served and not recorded")
        value = encode(turn)
        if len(value) > MAX_TURN_BYTES:
            raise UnrecordableTurn(
                "too_large", f"the turn's record of {len(value)} bytes exceeds the limit of {MAX_TURN_BYTES}"
            )
        nonce = None
        if unnumbered:
            nonce = uuid.uuid4().bytes
            self._unnumbered += 1
            NUMBERED_LATE.inc()
        self._spool(_pack(turn.session_id.encode(), value, nonce))

    def record_session_end(self, ended: SessionEnded) -> None:
        """Spool a session's end (published to ``sessions.ended``, in spool order with the turns)."""
        self._spool(_pack(ended.session_id.encode(), encode(ended), session_end=True))

    def _spool(self, record: bytes) -> None:
        if not self._buffer and self.spool is not None:
            try:
                self.spool.write([record])
            except (OSError, ValueError) as exc:  # disk full; a spool closed by a shutdown under way
                log.error("spool write failed; turns wait in memory", extra={"error": repr(exc)})
                self._buffer.append(record)
                self._buffer_bytes += len(record)
        else:  # earlier turns still wait in memory: keep the order
            self._buffer.append(record)
            self._buffer_bytes += len(record)
        self._buffered.set()

    @property
    def pending(self) -> int:
        return len(self._buffer) + (self.spool.pending + self.spool.unsynced if self.spool else 0)

    async def _writer(self) -> None:
        assert self.spool is not None
        while True:
            await self._buffered.wait()
            if not self._closing and self.spool.unsynced + len(self._buffer) < self.batch:
                await asyncio.sleep(
                    self.linger_s
                )  # group commit: one fsync for everything that arrives meanwhile
            self._buffered.clear()
            if self._buffer:  # only after a failed write
                batch = list(self._buffer)
                try:
                    await asyncio.to_thread(self.spool.write, batch)
                    del self._buffer[: len(batch)]  # record() appends behind them meanwhile
                    self._buffer_bytes -= sum(len(r) for r in batch)
                except OSError as exc:
                    log.error("spool write failed again", extra={"error": repr(exc), "waiting": len(batch)})
                    self._buffered.set()
                    await asyncio.sleep(1.0)
            synced = await asyncio.to_thread(self.spool.sync)
            SPOOL_BYTES.set(self.spool.unpublished_bytes + self._buffer_bytes)
            if synced:
                RECORDED.inc(synced)
                SPOOLED.set(self.spool.pending)
                self._wrote.set()
            if self._closing and not self._buffer and not self.spool.unsynced:
                return

    async def _connect(self) -> EventProducer:
        backoff = 0.2
        while True:
            producer = EventProducer(self.kafka, client_id=f"{self.kafka.client_id}-proxy")
            try:
                await producer.start(wait_s=0)  # this loop does the retrying, counted
                return producer
            except Exception as exc:
                with contextlib.suppress(Exception):
                    await producer.stop()
                PUBLISH_FAILURES.inc()
                log.warning("Kafka unreachable; turns stay in the spool", extra={"error": repr(exc)})
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)

    async def _publisher(self) -> None:
        assert self.spool is not None
        topic = TURNS.name(self.kafka.namespace)
        ends = SESSIONS_ENDED.name(self.kafka.namespace)
        backoff = 0.2
        while True:
            if self.spool.pending == 0:
                if self._closing and self._tasks[0].done():  # the writer has spooled its last turns too
                    return
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wrote.wait(), 1.0)
                if not self._wrote.is_set():
                    self.spool.flush_cursor()  # idle: persist where publishing got to
                self._wrote.clear()
                continue
            if self._producer is None:
                self._producer = await self._connect()
            # From memory in the common case; from the files (in a worker thread) after a long outage.
            in_memory = self.spool.in_memory
            records = (
                self.spool.peek(self.batch)
                if in_memory
                else await asyncio.to_thread(self.spool.peek, self.batch)
            )
            if not records:  # never spin, whatever the spool reports
                log.error(
                    "spool reports pending turns but none could be read",
                    extra={"pending": self.spool.pending},
                )
                await asyncio.sleep(1.0)
                continue
            futures = []
            nonces: list[bytes | None] = []
            try:  # every session's data key of the batch in one burst (a Redis outage: tried again below)
                await prefetch_keys(self.kafka, TURNS, (_key_of(rec) for rec in records))
            except Exception as exc:
                log.warning("cannot fetch the batch's data keys yet", extra={"error": repr(exc)})
            for rec in records:
                key, value, nonce, session_end = _unpack(rec)
                nonces.append(nonce)
                if nonce is not None:
                    try:
                        value = await self._numbered(key.decode(), nonce, value)
                    except Exception as exc:  # Redis still away: this turn and all behind it wait
                        futures.append(_failed(exc))
                        break
                try:
                    spec = SESSIONS_ENDED if session_end else TURNS
                    value = await seal_value(self.kafka, spec, key, value)  # spooled in the clear (0600)
                    futures.append(
                        await self._producer.send_raw_nowait(ends if session_end else topic, value, key)
                    )
                except SessionForgotten:  # forgotten while on its way: never written, counted, let go
                    FORGOTTEN.labels(ends if session_end else topic).inc()
                    futures.append(_done())
                except Exception as exc:
                    futures.append(_failed(exc))
            results = await asyncio.gather(*futures, return_exceptions=True)
            ok = 0
            for r in results:
                if isinstance(r, BaseException):
                    break
                ok += 1
            if ok:
                if in_memory and self.spool.in_memory:
                    self.spool.commit(ok)
                else:
                    await asyncio.to_thread(self.spool.commit, ok)
                self._backlog = max(self._backlog - ok, 0)
                for nonce in nonces[:ok]:
                    if nonce is not None:
                        self._numbers.pop(nonce, None)
                PUBLISHED.inc(ok)
                SPOOLED.set(self.spool.pending)
                SPOOL_BYTES.set(self.spool.unpublished_bytes + self._buffer_bytes)
                backoff = 0.2
            if ok < len(records):
                PUBLISH_FAILURES.inc()
                log.warning(
                    "publishing turns failed; retrying from the spool",
                    extra={"published": ok, "failed": len(records) - ok, "error": repr(results[ok])},
                )
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)

    async def _numbered(self, session_id: str, nonce: bytes, value: bytes) -> bytes:
        """The turn with its real number (asked once per nonce in this run; Redis remembers it across runs)."""
        n = self._numbers.get(nonce)
        if n is None:
            if self.number_once is None:
                raise RuntimeError("an unnumbered turn in the spool, and no way to number it")
            n = await self.number_once(session_id, nonce)
            self._numbers[nonce] = n
            self._unnumbered = max(self._unnumbered - 1, 0)
        turn = decode(value, Turn)
        return encode(msgspec.structs.replace(turn, turn_index=n, turn_id=f"{session_id}:{n}"))

    async def stop(self, drain_timeout_s: float = 10.0) -> None:
        """Flush the buffer to the spool, give Kafka a moment to take what is spooled, then close."""
        self._closing = True
        self._buffered.set()
        self._wrote.set()
        if self._tasks:
            # What is only in memory (the spool could not be written) is waited for longer: it exists nowhere else.
            writer_timeout = max(drain_timeout_s, self.stop_write_timeout_s if self._buffer else 0.0)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._tasks[0], writer_timeout)
            if self._buffer:
                DROPPED.labels("unwritten_at_stop").inc(len(self._buffer))
                log.error(
                    "stopping with turns that could not be written to the spool: they are lost",
                    extra={"lost": len(self._buffer), "waited_s": writer_timeout, "dir": str(self.spool_dir)},
                )
            try:
                await asyncio.wait_for(self._tasks[1], drain_timeout_s)
            except TimeoutError:
                log.warning("stopping with turns still spooled", extra={"pending": self.pending})
            for t in self._tasks:
                t.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._producer is not None:
            with contextlib.suppress(Exception):
                await self._producer.stop()
        if self.spool is not None:
            self.spool.close()


def _done() -> asyncio.Future[None]:
    fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    fut.set_result(None)
    return fut


def _failed(exc: BaseException) -> asyncio.Future[None]:
    fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    fut.set_exception(exc)
    return fut

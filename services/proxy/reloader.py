"""The weight reloader: follows ``weights`` and has the engine load each newer version.

Runs in the proxy process and reads the compacted topic from its start without a consumer group (every proxy
replica sees every version). Only paths below the configured weights root are loaded; anything else is
dead-lettered.

The update protocol suits SGLang 0.5.23: a plain ``/update_weights_from_disk`` takes a writer lock that waits for
every in-flight generation to finish while new requests queue behind it, so time to first token during a reload
would be the longest running generation plus the load (minutes on a CPU). Instead the reloader pauses generation
with ``retract`` (running requests go back to the queue keeping their output so far; new ones wait, none is
refused), loads (no lock while paused; the cache can be flushed), and continues: the retracted requests resume on
the new weights after recomputing their KV. Time to first token during a reload is the load time plus that
recompute. ``continue_generation`` runs in a ``finally`` and once at start-up, so an engine is never left paused by
a reloader that failed or died.

Under a gate (``gate.enabled``, docs/evaluation.md) the reloader also follows ``versions`` and serves what its
decisions say (``gated_target``): the promoted or pinned version, older ones included (a rollback loads the
version promoted before from the path its candidate decision recorded, or the engine's own starting weights); the
version the gate made a candidate is served while it awaits its verdict under ``serve-then-check`` (one at a time,
paced by the gate) or, under ``adapter``, the newest version is loaded beside the served adapter for its
evaluation and never routed to.

No version is loaded twice: before pausing and again once paused the reloader reads ``/model_info`` and skips a
version the engine already serves. Several proxies reload the same engines: each pause-load-continue, and the
continue at start-up, runs under the engine's lease in Redis (services/proxy/engine_lease.py says why SGLang needs
it), and a reloader that finds the lease taken tries again a second later. After an engine restart (a probe sees
the starting weights again; see ServedVersions) the newest version is applied again.

With LoRA (``Config.lora_adapters``) a version is a PEFT adapter: it is loaded beside the one before under its own
name (no pause: SGLang loads an adapter between batches in milliseconds and the base weights never change), new
requests go to it (``Adapters.serve``), and the older adapter is unloaded once the requests the proxy sent it have
reached the engine (SGLang finishes the running ones before unloading) and no evaluation holds it. After an engine
restart the probe finds no adapter: requests go to the base until the newest version is loaded again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, NamedTuple

from prometheus_client import Counter, Histogram

from runtime.configuration.config import GateConfig, KafkaConfig
from runtime.engine.client import EngineClient, EngineError, adapter_name, version_number
from runtime.messaging.bus import EventConsumer, Record, read_topic
from runtime.pipeline.promotion import Promotion
from runtime.transport.resp import RedisReplyError
from schemas import VersionDecision, WeightsPublished
from schemas.topics import VERSIONS, WEIGHTS
from services.proxy.adapters import Adapters
from services.proxy.engine_lease import EngineLease
from services.proxy.versions import ServedVersions

log = logging.getLogger("turnstream.proxy.reloader")

RELOADS = Counter(
    "turnstream_proxy_weight_reloads_total", "Weight versions the engine was asked to load", ["status"]
)
HELD = Counter(
    "turnstream_proxy_reload_held_total", "Versions kept serving a while longer for their held-out evaluation"
)
RETIRED = Counter(
    "turnstream_proxy_adapters_unloaded_total", "Older LoRA adapters unloaded from the engine", ["status"]
)
RELOAD_SECONDS = Histogram(
    "turnstream_proxy_weight_reload_seconds",
    "From pausing generation to continuing it, for one weight version",
    buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600),
)


def inside(root: Path, path: str) -> bool:
    try:
        Path(os.path.realpath(path)).relative_to(os.path.realpath(root))
        return True
    except ValueError:
        return False


class Wanted(NamedTuple):
    """A version to have the engine serve, where its weights are, and the record that announced it (if any)."""

    version: int
    path: str
    rec: Record[Any] | None


class Target(NamedTuple):
    serve: int
    """The version users are served."""
    beside: int | None
    """``adapter`` mechanism: a candidate loaded beside it for its evaluation, not served."""


def gated_target(promotion: Promotion, newest: int | None, mechanism: str) -> Target:
    """What the engine should hold under a gate: the promoted (or pinned) version for users; under
    ``serve-then-check`` (full weights: evaluated while served, rolled back when it fails) the version the gate
    made a candidate, served while it awaits its verdict (the gate paces them: docs/evaluation.md); under
    ``adapter`` the newest version, while it awaits its verdict, loaded beside."""
    if mechanism == "serve-then-check":
        promoted = promotion.promoted
        trying = [v for v, s in promotion.states.items() if s == "candidate" and v > promoted]
        return Target(max(trying) if trying and promotion.pinned is None else promotion.serving, None)
    if (
        newest is None
        or newest <= promotion.promoted
        or promotion.state(newest) not in ("unknown", "candidate")
    ):
        return Target(promotion.serving, None)
    return Target(promotion.serving, newest)


class Reloader:
    def __init__(
        self,
        kafka: KafkaConfig,
        engine: EngineClient,
        weights_root: Path,
        versions: ServedVersions,
        *,
        pause_mode: str = "retract",
        retry_s: float = 5.0,
        held: Callable[[int], Awaitable[bool]] | None = None,
        adapters: Adapters | None = None,
        drain_timeout_s: float = 300.0,
        gate: GateConfig | None = None,
        name: str = "",
        primary: bool = True,
        lease: EngineLease | None = None,
    ) -> None:
        self.engine = engine
        self.name = name
        """The policy replica it reloads (one reloader per replica)."""
        self.primary = primary
        """Dead-letters the records no replica can take (a path outside the root, the wrong format): one copy, not
        one per replica."""
        self.root = weights_root
        self.versions = versions
        self.pause_mode = pause_mode
        self.retry_s = retry_s
        self.held = held
        """Whether the served version must stay a while longer (``turnstream eval`` is evaluating it)."""
        self._held_version = -1
        self.adapters = adapters
        """Set: versions are LoRA adapters, loaded beside each other and routed to (see the module's text)."""
        self.drain_timeout_s = drain_timeout_s
        self._retiring: dict[int, asyncio.Task[None]] = {}
        self.newest: Record[WeightsPublished] | None = None
        """The newest valid version seen on the topic: what the engine should serve."""
        self._lock = asyncio.Lock()
        self._reapply: asyncio.Task[None] | None = None
        gated = gate is not None and gate.enabled
        self.promotion: Promotion | None = Promotion() if gated else None
        """Under a gate (``gate.enabled``): the fold of ``versions``, which says what is served."""
        self.mechanism = gate.mechanism if gate is not None else "adapter"
        self.paths: dict[int, str] = {}
        """Each version's weights folder, from its candidate decision (``weights`` keeps only the newest)."""
        self.unloadable: set[int] = set()
        """Versions the engine refused or whose path is not below the root: not asked for again."""
        self._versions_next = 0
        """The offset of the next ``versions`` record to apply (one partition)."""
        self._keep: set[int] = set()
        """Gated adapters: the versions the engine must hold (served, and the candidate beside)."""
        self.base_path: str | None = None
        """The starting weights (version 0) as the engine was started with them, for a rollback to them."""
        self.lease = lease
        """Held while this reloader pauses, loads or continues the engine (several proxies); None: one proxy."""
        self.consumer = self._follower(kafka, gated)

    @staticmethod
    def _follower(kafka: KafkaConfig, gated: bool = False) -> EventConsumer:
        # No consumer group: every replica reads every version from the compacted topic's start, and no restart
        # leaves an abandoned group behind on the broker. Versions are minutes apart, so empty fetches wait 5 s
        # (a new version still arrives at once): as a group member with half-second fetches the reloader cost an
        # idle proxy ~20 ms of CPU per second, now ~0.
        return EventConsumer(
            kafka,
            [WEIGHTS, VERSIONS] if gated else [WEIGHTS],
            f"turnstream-reloader-{uuid.uuid4().hex[:12]}",
            group=False,
            fetch_max_wait_ms=5000,
            poll_timeout_ms=5000,
            background_poll_ms=5000,
        )

    async def handle(self, batch: list[Record[Any]]) -> None:
        for rec in batch:
            if isinstance(rec.event, VersionDecision):
                self._decided(rec)
                continue
            if not inside(self.root, rec.event.path):
                await self._invalid(rec, f"weights path {rec.event.path} is outside {self.root}")
                continue
            if (rec.event.format == "peft-lora") != (self.adapters is not None):
                await self._invalid(rec, self._format_refusal(rec.event.format))
                continue
            if self.newest is None or rec.event.version > self.newest.event.version:
                self.newest = rec
        await self.apply()

    async def _invalid(self, rec: Record[Any], why: str) -> None:
        if self.primary:
            RELOADS.labels("refused").inc()
            await self.consumer.dead_letter(rec, why)

    def serves_wanted(self, serving: int) -> bool:
        """Whether an engine serving ``serving`` serves what this reloader would have it serve (or what it can:
        a version its engine refused does not count against it). Until a version is known, any."""
        if self.promotion is not None:
            newest = self.newest.event.version if self.newest is not None else None
            target = gated_target(self.promotion, newest, self.mechanism).serve
            return serving == target or target in self.unloadable
        if self.newest is None or self.newest.event.version in self.unloadable:
            return True
        return serving >= self.newest.event.version

    def _format_refusal(self, fmt: str) -> str:
        if self.adapters is None:
            return (
                f"version is a {fmt} adapter but this proxy serves full weights: turn trainer.lora on for the proxy"
                " too (its engine started with --enable-lora), or publish merged weights (trainer.lora.publish)"
            )
        return f"version is {fmt} (full weights) but this proxy serves LoRA adapters (trainer.lora is on)"

    def engine_changed(self, version: int) -> None:
        """A probe saw the engine's version change (after a restart it serves the starting weights again), or saw it
        answer again after it did not (a version published meanwhile could not be loaded)."""
        if self.promotion is not None:  # under a gate a version may be older on purpose: apply decides
            self._later(0.0)
            return
        if self.newest is not None and version < self.newest.event.version:
            log.warning(
                "engine serves an older version than published (restarted?); applying the newest again",
                extra={"engine_version": version, "newest": self.newest.event.version},
            )
            self._later(0.0)

    def _later(self, delay_s: float) -> None:
        if self._reapply is None or self._reapply.done():

            async def again() -> None:
                await asyncio.sleep(delay_s)
                self._reapply = None  # so that this apply can schedule the next one
                await self.apply()

            self._reapply = asyncio.create_task(again())

    async def _engine_version(self) -> int:
        return version_number((await self.engine.model_info()).get("weight_version"))

    async def apply(self) -> None:
        """Bring the engine to the version it should serve: the newest, or under a gate the one ``gated_target``
        names."""
        async with self._lock:
            if self.promotion is not None:
                await self._apply_gated(self.promotion)
                return
            rec = self.newest
            if rec is None:
                return
            if self.adapters is not None:
                await self._apply_adapter(rec, self.adapters)
                return
            await self._load_full(Wanted(rec.event.version, rec.event.path, rec), exact=False)

    async def _load_full(self, want: Wanted, *, exact: bool) -> None:
        """Have the engine serve ``want`` unless it serves it (``exact``: that very version; else it or a newer
        one) already."""

        def there(serving: int) -> bool:
            return serving == want.version if exact else serving >= want.version

        try:
            serving = await self._engine_version()
        except EngineError as exc:
            log.warning("engine unreachable; version %s waits", want.version, extra={"error": str(exc)})
            return  # the next probe that finds the engine (or the next version) tries again
        if there(serving):
            self.versions.changed(serving)
            return
        if await self._is_held(serving):
            self._later(1.0)
            return
        async with self._exclusive() as mine:
            if mine:
                await self._pause_load_continue(want, there)

    @contextlib.asynccontextmanager
    async def _exclusive(self) -> AsyncIterator[bool]:
        """The engine's lease held for the block (always, with no lease configured); False: another reloader holds
        it or Redis cannot say, and the version is tried again shortly."""
        if self.lease is None:
            yield True
            return
        async with self.lease.hold() as mine:
            if not mine:
                self._later(1.0)
            yield mine

    async def _pause_load_continue(self, want: Wanted, there: Callable[[int], bool]) -> None:
        loop = asyncio.get_running_loop()
        began = loop.time()
        paused = False
        try:
            await self.engine.pause_generation(self.pause_mode)
            paused = True
            if there(serving := await self._engine_version()):  # another reloader got there
                self.versions.changed(serving)
                return
            if await self._is_held(serving):  # an evaluation began while this reload was starting
                self._later(1.0)
                return
            await self.engine.update_weights_from_disk(want.path, str(want.version))
        except EngineError as exc:
            # A failed answer can still mean loaded (SGLang answers 400 when only its cache flush failed).
            loaded = False
            try:
                loaded = await self._engine_version() == want.version
            except EngineError:
                pass
            if not loaded:
                self._failed(want.version, exc)
                if exc.status is not None and 400 <= exc.status < 500:  # refused: asking again won't help
                    await self._refused(want, f"engine could not load version {want.version}: {exc}")
                else:  # unreachable or timed out: try again shortly (the check above prevents a double load)
                    self._later(self.retry_s)
                return
        finally:
            if paused:
                await self._continue()
            RELOAD_SECONDS.observe(loop.time() - began)
        self.versions.changed(want.version)
        RELOADS.labels("ok").inc()
        log.info(
            "engine serves a new weight version",
            extra={"replica": self.name, "version": want.version, "path": want.path},
        )

    async def _refused(self, want: Wanted, why: str) -> None:
        """A version the engine refused: never asked for again (dead-lettered when a record announced it)."""
        if want.rec is not None:
            await self.consumer.dead_letter(want.rec, why)
        self.unloadable.add(want.version)
        if self.newest is not None and self.newest.event.version == want.version:
            self.newest = None

    async def _apply_gated(self, promotion: Promotion) -> None:
        newest = self.newest.event.version if self.newest is not None else None
        target = gated_target(promotion, newest, self.mechanism)
        if self.adapters is not None:
            await self._apply_adapters_gated(target, self.adapters)
            return
        # The target, else (its weights gone or refused) the versions promoted before it, down to the start:
        # never the rolled-back one that may be serving now.
        for version in [target.serve, *reversed(promotion.history), 0]:
            if version in self.unloadable or version > target.serve:
                continue
            want = await self._wanted(version)
            if want is not None:
                await self._load_full(want, exact=True)
                return

    async def _wanted(self, version: int) -> Wanted | None:
        """Where version ``version``'s weights are: the starting weights' path the engine was started with, the
        newest announcement's, or a decision's (a rollback or pin to a version ``weights`` no longer holds)."""
        if version == 0:
            if self.base_path is None:  # /model_info names the weights loaded last; the launch's are these
                try:
                    self.base_path = str((await self.engine.server_info()).get("model_path") or "") or None
                except EngineError as exc:
                    log.warning("engine unreachable; the starting weights wait", extra={"error": str(exc)})
                    return None
            return Wanted(0, self.base_path, None) if self.base_path else None
        if self.newest is not None and self.newest.event.version == version:
            return Wanted(version, self.newest.event.path, self.newest)
        path = self.paths.get(version)
        if path is None or not inside(self.root, path):
            if version not in self.unloadable:
                self.unloadable.add(version)
                RELOADS.labels("refused").inc()
                log.error(
                    "the version to serve has no weights path below the weights root; serving stays as it is",
                    extra={"version": version, "path": path},
                )
            return None
        return Wanted(version, path, None)

    async def _apply_adapter(self, rec: Record[WeightsPublished], adapters: Adapters) -> None:
        event = rec.event
        try:
            loaded = await self.engine.adapter_versions()
        except EngineError as exc:
            log.warning("engine unreachable; version %s waits", event.version, extra={"error": str(exc)})
            return
        newest = max(loaded, default=0)
        if adapters.current not in loaded | {0}:  # the engine restarted and lost it: the base until reloaded
            adapters.serve(newest)
            self.versions.changed(newest)
        if newest >= event.version:
            adapters.serve(newest)
            self.versions.changed(newest)
            self._retire(loaded - {newest}, adapters)
            return
        if await self._is_held(adapters.current):
            self._later(1.0)
            return
        began = asyncio.get_running_loop().time()
        try:
            await self.engine.load_lora_adapter(adapter_name(event.version), event.path)
        except EngineError as exc:
            with contextlib.suppress(EngineError):  # "already loaded" by another replica is loaded
                loaded = await self.engine.adapter_versions()
            if event.version not in loaded:
                self._failed(event.version, exc)
                if exc.status is not None and 400 <= exc.status < 500:
                    await self.consumer.dead_letter(
                        rec, f"engine could not load adapter {event.version}: {exc}"
                    )
                    self.newest = None
                else:
                    self._later(self.retry_s)
                return
        finally:
            RELOAD_SECONDS.observe(asyncio.get_running_loop().time() - began)
        adapters.serve(event.version)
        self.versions.changed(event.version)
        RELOADS.labels("ok").inc()
        log.info(
            "engine serves a new adapter",
            extra={"replica": self.name, "version": event.version, "path": event.path},
        )
        self._retire(loaded - {event.version}, adapters)

    async def _apply_adapters_gated(self, target: Target, adapters: Adapters) -> None:
        """Users go to ``target.serve`` (0: the base); a candidate is loaded beside it for its evaluation, never
        routed to; every other adapter is retired."""
        try:
            loaded = await self.engine.adapter_versions()
        except EngineError as exc:
            log.warning("engine unreachable; adapters wait", extra={"error": str(exc)})
            return
        keep = {v for v in (target.serve, target.beside) if v}
        self._keep = keep
        for version in keep:  # wanted again (a rollback, a pin): not unloaded after all
            retiring = self._retiring.pop(version, None)
            if retiring is not None:
                retiring.cancel()
        for version in sorted(keep - loaded - self.unloadable):
            want = await self._wanted(version)
            if want is None:
                continue
            began = asyncio.get_running_loop().time()
            try:
                await self.engine.load_lora_adapter(adapter_name(version), want.path)
                loaded.add(version)
                RELOADS.labels("ok").inc()
                log.info(
                    "engine holds an adapter", extra={"version": version, "serving": version == target.serve}
                )
            except EngineError as exc:
                with contextlib.suppress(EngineError):  # "already loaded" by another replica is loaded
                    loaded = await self.engine.adapter_versions()
                if version not in loaded:
                    self._failed(version, exc)
                    if exc.status is not None and 400 <= exc.status < 500:
                        await self._refused(want, f"engine could not load adapter {version}: {exc}")
                    else:
                        self._later(self.retry_s)
            finally:
                RELOAD_SECONDS.observe(asyncio.get_running_loop().time() - began)
        # The target once it is loaded; meanwhile what is served now, or the base if the engine lost that too.
        available = loaded | {0}
        serve = (
            target.serve
            if target.serve in available
            else adapters.current
            if adapters.current in available
            else 0
        )
        adapters.serve(serve)
        self.versions.changed(serve)
        self._retire(loaded - keep - {serve}, adapters)

    def _failed(self, version: int, exc: EngineError) -> None:
        RELOADS.labels("failed").inc()
        log.error("engine could not load a weight version", extra={"version": version, "error": str(exc)})

    def _retire(self, versions: set[int], adapters: Adapters) -> None:
        """Unload each older adapter in the background, once it is drained and not held for its evaluation."""
        for version in versions:
            if version not in self._retiring:
                self._retiring[version] = asyncio.create_task(self._unload(version, adapters))

    async def _unload(self, version: int, adapters: Adapters) -> None:
        try:
            try:
                await asyncio.wait_for(adapters.drained(version), self.drain_timeout_s)
            except TimeoutError:  # open longer than any request should be (a lease never released: a bug)
                RETIRED.labels("forced").inc()  # SGLang still finishes what it runs before unloading
            while True:  # until its evaluation (if one holds it) ends; the hold expires by itself
                if not await self._is_held(version):
                    break
                await asyncio.sleep(1.0)
            if version == adapters.current or version in self._keep:  # wanted again meanwhile
                return
            await self.engine.unload_lora_adapter(adapter_name(version))
            RETIRED.labels("ok").inc()
            log.info("older adapter unloaded", extra={"version": version})
        except EngineError as exc:
            RETIRED.labels("failed").inc()
            log.warning("could not unload an older adapter", extra={"version": version, "error": str(exc)})
        finally:
            self._retiring.pop(version, None)

    async def _is_held(self, serving: int) -> bool:
        if self.held is None:
            return False
        try:
            held = await self.held(serving)
        except (OSError, TimeoutError, RedisReplyError) as exc:
            log.warning("could not check for an evaluation hold; reloading", extra={"error": str(exc)})
            return False
        if held and self._held_version != serving:
            self._held_version = serving
            HELD.inc()
            log.info("version %s is being evaluated; the next waits", serving)
        return held

    async def _continue(self) -> None:
        """Until the engine takes it: a paused engine serves no one."""
        delay = 0.2
        while True:
            try:
                await self.engine.continue_generation()
                return
            except EngineError as exc:
                log.error("could not continue generation; retrying", extra={"error": str(exc)})
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)

    async def _read_decisions(self) -> None:
        """Every decision so far, before anything is applied: a history read in part (one batch of it) could
        name a version the gate has since rolled back."""
        assert self.promotion is not None
        async for rec in read_topic(self.consumer.kafka, VERSIONS):
            self._decided(rec)

    def _decided(self, rec: Record[VersionDecision]) -> None:
        """A decision read once: the follower reads ``versions`` from its start again, after ``_read_decisions``."""
        if self.promotion is None or rec.offset < self._versions_next:
            return
        self._versions_next = rec.offset + 1
        self.promotion.apply(rec.event)
        if rec.event.path:
            self.paths[rec.event.version] = rec.event.path

    async def _continue_at_start(self) -> None:
        """An engine a crashed reloader left paused serves again. Not in the middle of another proxy's load (that
        one continues it itself), but once a dead reloader's lease has expired: tried for as long as a lease
        lasts."""
        tries = 1 if self.lease is None else int(self.lease.ttl_ms / 1000) + 5
        for _ in range(tries):
            async with self._exclusive() as mine:
                if mine:
                    try:
                        await self.engine.continue_generation()
                    except EngineError as exc:
                        log.info("engine not reachable yet", extra={"error": str(exc)})
                    return
            await asyncio.sleep(1.0)
        log.warning(
            "the engine's lease stayed taken; its holder continues the engine", extra={"replica": self.name}
        )

    async def _watch_pauses(self) -> None:
        """An engine a reloader paused and did not continue (killed between pause and continue, or its continue
        never reached the engine) serves again: every lease period, when the engine's lease is free (no
        pause-load-continue under way anywhere) and this reloader is not loading, it continues the engine, which
        changes nothing for one that runs. A dead holder's lease expires within a period, so such a pause ends
        within two (issue 55: it lasted until another proxy started)."""
        assert self.lease is not None
        period = self.lease.ttl_ms / 1000
        while True:
            await asyncio.sleep(period)
            async with self._lock, self.lease.hold() as mine:
                if not mine:
                    continue
                try:
                    await self.engine.continue_generation()
                except EngineError as exc:  # down or restarting: its probe and the next period see to it
                    log.debug("engine not continued", extra={"replica": self.name, "error": str(exc)})

    async def run(self) -> None:
        await self._continue_at_start()
        watcher = asyncio.create_task(self._watch_pauses()) if self.lease is not None else None
        try:
            await self._follow()
        finally:
            if watcher is not None:
                watcher.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await watcher

    async def _follow(self) -> None:
        backoff = 0.5
        while True:  # Kafka may not be up yet: serving goes on, the reloader keeps trying
            try:
                await self.consumer.start()
                if self.promotion is not None:
                    await self._read_decisions()
                break
            except Exception as exc:
                log.warning("reloader cannot reach Kafka yet", extra={"error": repr(exc)})
                await self.consumer.stop()
                self.consumer = self._follower(self.consumer.kafka, self.promotion is not None)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 10.0)
        try:
            await self.consumer.run(self.handle)
        finally:  # also when cancelled at shutdown: nothing to commit without a group, but close the connections
            await self.consumer.stop()

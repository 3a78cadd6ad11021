"""Which weight version served a streamed turn: SGLang's stream chunks carry none.

The proxy keeps a history of the versions the engine is known to have served (``changed`` on every load the
reloader starts and finishes, and on every change a probe of ``/model_info`` sees, a restart to the starting weights
included). A streamed turn notes where in that history it started; once it completes it waits for a probe that
*began after* it completed, and is labelled with the oldest version in the history from its start to that probe.
So a turn is never labelled newer than the weights that produced any of its tokens: a reload mid-stream labels it
with the version before, and a restart that put the starting weights back (which a probe sees before the reloader
can re-apply the newest version) labels it 0, even when the reloader re-applied the version since.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

from prometheus_client import Counter, Gauge

log = logging.getLogger("turnstream.proxy.versions")

PROBES = Counter("turnstream_proxy_version_probes_total", "Probes of the engine's weight version", ["status"])
VERSION = Gauge(
    "turnstream_proxy_weight_version",
    "Weight version each policy replica serves, as the proxy knows it",
    ["replica"],
)

Probe = Callable[[], Awaitable[int]]


class ServedVersions:
    def __init__(self, version: int = 0, *, keep: int = 4096, replica: str = "") -> None:
        self._gauge = VERSION.labels(replica) if replica else None
        """The replica's series of ``turnstream_proxy_weight_version`` (none for an unnamed one: a placeholder)."""
        self.reachable = True
        """The last probe found the engine (a replica that does not answer gets no traffic)."""
        self._history: list[int] = [version]
        """Every version the engine served, in order; index = epoch."""
        self._base = 0
        """The epoch of _history[0] (old entries are dropped past ``keep``)."""
        self._keep = keep
        self._probes_done = 0
        self._probe_started: list[float] = []
        self._wake = asyncio.Event()
        self._confirmed = asyncio.Condition()
        self._waiting = 0
        self._last_probe_started = float("-inf")
        if self._gauge is not None:
            self._gauge.set(version)

    @property
    def current(self) -> int:
        return self._history[-1]

    @property
    def epoch(self) -> int:
        return self._base + len(self._history) - 1

    def changed(self, version: int) -> None:
        """The engine serves (or is about to serve, or may serve) ``version`` from now on."""
        if version == self.current:
            return
        self._history.append(version)
        if len(self._history) > self._keep:
            drop = len(self._history) - self._keep
            del self._history[:drop]
            self._base += drop
        if self._gauge is not None:
            self._gauge.set(version)

    def oldest_since(self, epoch: int) -> int:
        start = max(epoch - self._base, 0)
        return min(self._history[start:])

    async def label(self, started_epoch: int, timeout_s: float = 30.0) -> int:
        """The version to record for a stream that started at ``started_epoch`` and has just completed: waits
        for the next probe that starts after now (``timeout_s`` at most: then the oldest version seen so far)."""
        completed = time.monotonic()
        self._waiting += 1
        self._wake.set()
        try:
            async with self._confirmed:
                await asyncio.wait_for(
                    self._confirmed.wait_for(lambda: self._last_probe_started > completed), timeout_s
                )
        except TimeoutError:
            PROBES.labels("label_timeout").inc()
        finally:
            self._waiting -= 1
        return self.oldest_since(started_epoch)

    async def run(
        self, probe: Probe, interval_s: float = 2.0, on_change: Callable[[int], None] | None = None
    ) -> None:
        """Probe the engine every ``interval_s``, and at once while streamed turns wait for a label."""
        while True:
            if not self._waiting:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), interval_s)
            self._wake.clear()
            started = time.monotonic()
            try:
                version = await probe()
            except Exception as exc:  # an engine that is down (restarting): labels wait, serving goes on
                PROBES.labels("failed").inc()
                self.reachable = False
                log.debug("weight version probe failed", extra={"error": repr(exc)})
                await asyncio.sleep(min(interval_s, 0.5))
                continue
            PROBES.labels("ok").inc()
            back, moved = not self.reachable, version != self.current
            self.reachable = True
            if moved:
                log.info("engine weight version changed", extra={"from": self.current, "to": version})
                self.changed(version)
            # Back after being unreachable, even on the same version: a version published while it was down
            # could not be loaded, and nothing else would ask again.
            if (moved or back) and on_change is not None:
                on_change(version)
            async with self._confirmed:
                self._last_probe_started = started
                self._confirmed.notify_all()

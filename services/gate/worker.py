"""``turnstream gate``: decides which weight versions are promoted (docs/evaluation.md).

Each cycle (``gate.poll_s``) it reads ``versions``, ``evals`` and ``weights`` whole and asks ``GateState`` what is
due: new candidates, superseded ones, verdicts. Rebuilding from the topics each time makes it idempotent and
restartable without state of its own (the three topics hold one record per version and set, so a cycle reads
little). Run one gate per pipeline: two would each send the same decisions.
"""

from __future__ import annotations

import asyncio
import logging
import signal

from prometheus_client import Counter, Gauge

from runtime.configuration.config import Config
from runtime.messaging.bus import EventProducer, read_topic
from runtime.observability.metrics import serve_metrics
from runtime.pipeline.evalsets import load_set, question_set_id
from runtime.pipeline.personas import heldout_questions
from schemas.topics import EVALS, VERSIONS, WEIGHTS
from services.gate.decide import GateState

log = logging.getLogger("turnstream.gate")

DECISIONS = Counter("turnstream_gate_decisions_total", "Decisions the gate made", ["state"])
SERVING = Gauge("turnstream_gate_serving_version", "The version users are to be served (promoted, or pinned)")
FAILED = Gauge(
    "turnstream_gate_failed_streak", "Candidates failed in a row since the last promotion or restore"
)


def required_sets(config: Config) -> tuple[list[str], str | None]:
    """The question set ids a candidate is judged on, and the held-out set's (None when not gated on it)."""
    gc = config.gate
    heldout = question_set_id(heldout_questions()) if gc.heldout else None
    sets = [load_set(path).set_id for path in gc.sets]
    return ([heldout] if heldout else []) + sets, heldout


async def read_state(config: Config, required: list[str], heldout: str | None) -> GateState:
    state = GateState(config.gate, required, heldout)
    async for r in read_topic(config.kafka, VERSIONS):
        state.decided(r.event)
    async for r in read_topic(config.kafka, EVALS):
        state.evaluated(r.event)
    async for r in read_topic(config.kafka, WEIGHTS):
        state.published(r.event)
    return state


async def run_gate(
    config: Config, *, install_signals: bool = True, stop: asyncio.Event | None = None, standby: bool = False
) -> None:
    """Until SIGTERM/SIGINT or ``stop``: decide each version's promotion. ``standby``: with ``gate.enabled`` off,
    stay up deciding nothing instead of refusing to start (compose runs the gate always, so that one setting,
    ``GATE_ENABLED``, turns guarding on for the gate, the proxy and the trainer together)."""
    if not config.gate.enabled and not standby:
        raise SystemExit("turnstream gate: gate.enabled is off (TURNSTREAM_GATE_ENABLED=true turns it on)")
    required, heldout = required_sets(config)
    if not required:
        raise SystemExit("turnstream gate: nothing to judge on: turn gate.heldout on or name gate.sets")
    stop = stop or asyncio.Event()
    if install_signals:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
    serve_metrics(config.metrics.port, config.metrics.host)
    if not config.gate.enabled:
        log.info("gate standing by: gate.enabled is off, so every published version is served as it comes")
        await stop.wait()
        return
    log.info("gate running", extra={"required": required, "mechanism": config.gate.mechanism})
    async with EventProducer(config.kafka, client_id=f"{config.kafka.client_id}-gate") as producer:
        while not stop.is_set():
            state = await read_state(config, required, heldout)
            for d in state.pending():
                await producer.send(VERSIONS, d, "policy")
                DECISIONS.labels(d.state).inc()
                log.info(
                    "version decided",
                    extra={"version": d.version, "state": d.state, "reason": d.reason, "against": d.against},
                )
            SERVING.set(state.promotion.serving)
            FAILED.set(state.promotion.failed_streak)
            try:
                await asyncio.wait_for(stop.wait(), config.gate.poll_s)
            except TimeoutError:
                pass

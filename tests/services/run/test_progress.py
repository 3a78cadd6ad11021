"""The progress line and status.json read the held-out evaluation's metrics like the others' (a real
prometheus_client exposition, served through httpx's mock transport)."""

from __future__ import annotations

import httpx
from prometheus_client import CollectorRegistry, Gauge, generate_latest

from services.run.progress import scrape


async def test_the_heldout_scores_reach_the_progress_line() -> None:
    registry = CollectorRegistry()
    score = Gauge("turnstream_eval_score", "x", ["persona"], registry=registry)
    version = Gauge("turnstream_eval_version", "x", registry=registry)
    score.labels("plain-short").set(0.5)
    score.labels("sign-off").set(0.125)
    version.set(3)
    body = generate_latest(registry)

    async with httpx.AsyncClient(
        transport=httpx.MockTransport(lambda _: httpx.Response(200, content=body))
    ) as http:
        progress = await scrape(http, {"eval": 9107}, batch_size=4)
    assert progress.heldout == {"plain-short": 0.5, "sign-off": 0.125} and progress.heldout_version == 3
    assert "held-out v3: plain-short 50%, sign-off 12%" in progress.line()

    empty = generate_latest(CollectorRegistry())
    async with httpx.AsyncClient(
        transport=httpx.MockTransport(lambda _: httpx.Response(200, content=empty))
    ) as http:
        nothing = await scrape(http, {"eval": 9107}, batch_size=4)
    assert nothing.heldout_version is None and "held-out" not in nothing.line()


async def test_turns_closed_without_a_next_state_reach_the_progress_line() -> None:
    """What the pairer counts in ``turnstream_pairer_unpaired_total`` (nothing is learned from those turns) is on
    the line, by why; a pipeline where every turn was paired says nothing about it."""
    from prometheus_client import Counter

    registry = CollectorRegistry()
    unpaired = Counter("turnstream_pairer_unpaired", "x", ["reason"], registry=registry)
    unpaired.labels("no_session").inc(5)
    unpaired.labels("session_done").inc(2)
    unpaired.labels("regenerated").inc(0)
    body = generate_latest(registry)
    async with httpx.AsyncClient(
        transport=httpx.MockTransport(lambda _: httpx.Response(200, content=body))
    ) as http:
        progress = await scrape(http, {"pairer": 9101}, batch_size=4)
    assert progress.unpaired == {"no_session": 5, "session_done": 2, "regenerated": 0}
    assert progress.line().endswith("| no next state: no session 5, done 2")
    empty = generate_latest(CollectorRegistry())
    async with httpx.AsyncClient(
        transport=httpx.MockTransport(lambda _: httpx.Response(200, content=empty))
    ) as http:
        assert "no next state" not in (await scrape(http, {"pairer": 9101}, batch_size=4)).line()

"""The console: its projection of the topics (idempotent, and rebuilt from a replay it equals the live one, on the
real broker), and its pages over it (every page answers, unknown ids are 404 pages, the turn inspector shows the
votes, the hint and a heat map with one cell per response token in the colour of its teacher - rollout gap)."""

from __future__ import annotations

import asyncio
import re
import sqlite3
import time
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest

from runtime.configuration.config import KafkaConfig
from runtime.messaging.bus import EventProducer
from schemas import Judgment, Turn, Vote, WeightsPublished
from schemas.topics import spec_for
from services.console.app import create_app
from services.console.feed import SHOWN, follow
from services.console.pages import gap_colour
from services.console.projection import apply, connect, dump, stored_offsets
from tests.services.dispatcher.conftest import eval_judgment
from tests.strategies import example_events, example_turn


def events(session_id: str = "s1") -> list[Any]:
    """One of every event about one turn, plus a hint judgment and a version that trained on the turn."""
    found = example_events(session_id)
    turn: Turn = msgspec.structs.replace(found[Turn], user="sign-off")  # type: ignore[type-var]
    found[Turn] = turn
    hint = Judgment(
        turn_id=turn.turn_id,
        session_id=session_id,
        judge_id="j1",
        kind="hint",
        votes=[Vote(raw="Say it plainly. [HINT_START]Say the answer plainly.[HINT_END]", score=1, hint="x")],
        paired=found[Judgment].paired,  # type: ignore[attr-defined]
        judge_model="rules",
        created_at=time.time(),
        accepted=True,
        hint="Say the answer plainly.",
    )
    trained = msgspec.structs.replace(
        found[WeightsPublished],  # type: ignore[type-var]
        sample_ids=[turn.turn_id],
        advantages=[0.4375],
        figures={"users": 5.0, "top_user_share": 0.25, "deferred_by_share": 36.0},
    )
    return [*(e for t, e in found.items() if t is not WeightsPublished), hint, trained]


def client(db: Path) -> httpx.AsyncClient:
    app = create_app(db, lambda ids: [f"<t{i}>" for i in ids])
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://console")


async def test_pages_show_the_pipeline_and_unknown_ids_are_404_pages(tmp_path: Path) -> None:
    db_path = tmp_path / "console.sqlite3"
    db = connect(db_path)
    apply(db, events())
    async with client(db_path) as http:
        overview = await http.get("/")
        assert overview.status_code == 200
        for stage in ("turns", "paired", "judged", "teacher", "samples", "versions"):
            assert f'data-stage="{stage}"' in overview.text
        assert "opd+rl" in overview.text and "bad bytes" not in overview.text and "decode" in overview.text

        sessions = await http.get("/sessions", params={"q": "s1"})
        assert sessions.status_code == 200 and 'href="/sessions/s1"' in sessions.text
        assert "s1" not in (await http.get("/sessions", params={"q": "nobody"})).text.split("<table>")[1]
        persona = await http.get("/sessions", params={"user": "sign-off"})
        assert 'href="/sessions/s1"' in persona.text and '<option value="sign-off"' in persona.text
        other = await http.get("/sessions", params={"user": "plain-short"})
        assert 'href="/sessions/s1"' not in other.text
        good = await http.get("/sessions", params={"outcome": "good"})
        assert 'href="/sessions/s1"' in good.text  # the turn's eval judgment is +1
        assert 'href="/sessions/s1"' not in (await http.get("/sessions", params={"outcome": "bad"})).text
        session = await http.get("/sessions/s1")
        assert session.status_code == 200 and 'href="/turns/s1%3A1"' in session.text

        page = await http.get("/turns/s1:1")
        assert page.status_code == 200
        text = page.text
        assert "What is 2+2?" in text and "thanks!" in text  # request and next state
        assert "\\boxed{1}" in text and "[HINT_START]" in text  # the judges' raw votes
        assert "Chosen hint (j1): <b>Say the answer plainly.</b>" in text
        assert "trained into" in text and "v1" in text
        # One cell per response token (ids 4, 5), coloured by teacher - rollout: -0.05 - -0.1 and -0.3 - -0.2.
        cells = re.findall(
            r'<span class="tok" style="background: ([^"]+)" title="[^"]+" data-gap="([^"]+)">', text
        )
        assert [float(g) for _, g in cells] == pytest.approx([0.05, -0.1])
        assert [c for c, _ in cells] == [gap_colour(0.05), gap_colour(-0.1)]
        assert "&lt;t4&gt;" in text  # token texts are escaped

        versions = await http.get("/versions")
        assert versions.status_code == 200 and "<polyline" in versions.text and "plain-short" in versions.text
        # each step's share figures (trainer.max_user_share): users, the top user's share, samples deferred
        assert "top user&#x27;s share" in versions.text or "top user's share" in versions.text
        assert re.search(r">5</span>.*>0\.25</span>.*>36</span>", versions.text, re.S)

        for missing in ("/turns/nope:1", "/sessions/nobody", "/no/such/page"):
            gone = await http.get(missing)
            assert gone.status_code == 404 and "Not found" in gone.text, missing
        api = await http.get("/api/turns/nope:1")
        assert api.status_code == 404 and api.json()["error"]["type"] == "not_found"
        inspected = (await http.get("/api/turns/s1:1")).json()
        assert inspected["trained_into"] == 1 and inspected["advantage"] == 0.4375
        assert "+0.4375" in (await http.get("/turns/s1:1")).text
        metrics = await http.get("/metrics")
        assert metrics.status_code == 200 and "turnstream_console_records_total" in metrics.text


async def test_the_overview_says_how_many_turns_closed_without_a_next_state(tmp_path: Path) -> None:
    """Lone turns that went idle (a client without sessions) are told apart from other terminal pairings, with a
    warning that points at the cause."""
    from schemas import PairedTurn

    db_path = tmp_path / "console.sqlite3"
    db = connect(db_path)
    closed = [
        (example_turn("lone", 1), "idle_timeout"),
        (example_turn("long", 3), "idle_timeout"),
        (example_turn("done", 2), "session_done"),
        (example_turn("regen", 2), "regenerated"),
    ]
    apply(db, [t for t, _ in closed])
    apply(
        db, [PairedTurn(turn=t, next_state=None, paired_at=time.time(), terminal_reason=r) for t, r in closed]
    )
    async with client(db_path) as http:
        text = (await http.get("/")).text
    rows = dict(
        re.findall(r"<tr><td>([^<]+)</td><td>(\d+)</td></tr>", text.split("Closed without a next state")[1])
    )
    assert rows == {
        "no session (one turn, then idle)": "1",
        "idle": "1",
        "session done": "1",
        "regenerated by the user": "1",
    }
    assert "nothing of them is judged or learned" in text
    db2 = tmp_path / "empty.sqlite3"
    connect(db2)
    async with client(db2) as http:
        assert "nothing of them is judged" not in (await http.get("/")).text


def test_heat_map_colours() -> None:
    assert gap_colour(1.0) == "rgba(0, 160, 0, 0.50)"
    assert gap_colour(-5.0) == "rgba(200, 0, 0, 1.00)"
    assert gap_colour(0.0) == "rgba(0, 160, 0, 0.00)"


def test_applying_a_record_twice_changes_nothing(tmp_path: Path) -> None:
    db = connect(tmp_path / "a.sqlite3")
    batch = events()
    apply(db, batch)
    once = dump(db)
    apply(db, batch[::-1])
    assert dump(db) == once and all(once[t] for t in ("turns", "judgments", "teacher", "samples", "evals"))


def test_a_sessions_outcome_is_its_last_judged_turns_whatever_the_arrival_order(tmp_path: Path) -> None:
    first, second = example_turn("s9", 1), example_turn("s9", 2)
    batch = [
        first,
        eval_judgment(first, 1, "j1"),
        second,
        eval_judgment(second, -1, "j1"),
        eval_judgment(second, 1, "j0"),
    ]
    forward, backward = connect(tmp_path / "f.sqlite3"), connect(tmp_path / "b.sqlite3")
    apply(forward, batch)
    for event in reversed(batch):  # judgments before their turns, one record per batch
        apply(backward, [event])
    assert dump(forward) == dump(backward)
    (row,) = dump(forward)["sessions"]
    # the last judged turn is 2; of its two judges the first by id (j0) says +1
    assert row[:3] == ("s9", "", 2) and row[-2:] == (2, "good")


def test_a_projection_of_an_older_layout_is_rebuilt(tmp_path: Path) -> None:
    path = tmp_path / "old.sqlite3"
    old = sqlite3.connect(path)
    old.execute("CREATE TABLE turns (turn_id TEXT PRIMARY KEY)")
    old.execute("CREATE TABLE offsets (topic TEXT, partition INTEGER, next_offset INTEGER)")
    old.execute("INSERT INTO offsets VALUES ('turns', 0, 99)")
    old.commit()
    old.close()
    db = connect(path)
    assert stored_offsets(db) == {}, "the feed starts again from the beginning"
    apply(db, events())
    assert len(dump(db)["turns"]) == 1 and dump(db)["sessions"][0][1] == "sign-off"


async def _publish(kafka: KafkaConfig, batch: list[Any]) -> None:
    by_type = {spec.event_type: spec for spec in SHOWN}
    async with EventProducer(kafka) as producer:
        for event in batch:
            spec = by_type.get(type(event))
            if spec is not None:
                await producer.send(spec, event, getattr(event, "session_id", "k"))


async def _project(
    kafka: KafkaConfig, path: Path, until: asyncio.Event | None = None
) -> tuple[Any, asyncio.Task[None], asyncio.Event]:
    db = connect(path)
    stop, caught_up = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(follow(kafka, db, stop, caught_up=caught_up))
    await asyncio.wait_for(caught_up.wait(), 60)
    return db, task, stop


@pytest.mark.integration
async def test_a_projection_rebuilt_from_a_replay_equals_the_live_one(
    kafka: KafkaConfig, tmp_path: Path
) -> None:
    await _publish(kafka, [*events("s1"), *events("s2")])
    live, task, stop = await _project(kafka, tmp_path / "live.sqlite3")
    await _publish(kafka, [*events("s3"), example_turn("s3", 2)])  # arriving while the console runs
    deadline = time.monotonic() + 60
    while len(dump(live)["turns"]) < 4 and time.monotonic() < deadline:  # noqa: ASYNC110 (polling a file)
        await asyncio.sleep(0.2)
    stop.set()
    await task
    rebuilt, task, stop = await _project(kafka, tmp_path / "rebuilt.sqlite3")
    stop.set()
    await task
    assert dump(rebuilt) == dump(live) and len(dump(live)["turns"]) == 4
    # a restart resumes from its stored offsets: nothing applied twice, nothing missed
    again, task, stop = await _project(kafka, tmp_path / "live.sqlite3")
    stop.set()
    await task
    assert dump(again) == dump(rebuilt)
    assert spec_for("evals").event_type.__name__ == "EvalResult"


async def test_the_versions_page_shows_the_gates_decisions_and_what_is_served(tmp_path: Path) -> None:
    """Under a gate each version's state comes from ``versions`` (the same fold the proxy serves by), with the
    reason and the failing checks, and the pin and the trainer's restore are in the log."""
    from schemas import VersionCheck, VersionDecision

    def decision(version: int, state: str, reason: str, by: str = "gate", **kw: Any) -> VersionDecision:
        return VersionDecision(
            version=version, state=state, reason=reason, by=by, decided_at=time.time(), **kw
        )

    db_path = tmp_path / "console.sqlite3"
    db = connect(db_path)
    failing = VersionCheck(name="heldout:plain-short", value=0.31, bound=0.95, passed=False)
    apply(
        db,
        [
            decision(1, "candidate", "published"),
            decision(1, "promoted", "every check passed"),
            decision(2, "rejected", "1 check failed", checks=[failing], against=1),
            decision(3, "rejected", "1 check failed", checks=[failing], against=1),
            decision(1, "restored", "2 candidates failed the gate in a row", by="trainer"),
            decision(1, "pinned", "freeze while we look", by="manual"),
        ],
    )
    async with client(db_path) as http:
        text = (await http.get("/versions")).text
        api = (await http.get("/api/decisions")).json()
        rows = {r["version"]: r for r in (await http.get("/api/versions")).json()}
    assert "Serving <b>v1</b>, pinned (promoted: v1)" in text
    assert "heldout:plain-short: 0.310 &lt; 0.950" in text and "freeze while we look" in text
    assert 'title="every check passed">promoted (serving)<' in text
    assert api["serving"] == 1 and api["failed_streak"] == 0 and api["recent"][0]["state"] == "pinned"
    assert api["recent"][3]["failed_checks"][0]["name"] == "heldout:plain-short"
    assert {v: r["state"] for v, r in rows.items()} == {1: "promoted", 2: "rejected", 3: "rejected"}
    assert rows[2]["reason"] == "1 check failed" and rows[1]["serving"] is True


async def test_every_session_id_the_proxy_accepts_opens(tmp_path: Path) -> None:
    """Issue 42: a session id with ``/`` (every id under per-user keys: ``alice/s1``) was a 404. The links the
    pages write open the session and its turns for any printable ASCII id, ``..`` and ``?#%`` included."""
    import html

    ids = ["alice/s1", "bob/anon-1/x", "a?b#c%d&e", "..", ".", "sp ace", "x:1", "<b>"]
    db_path = tmp_path / "console.sqlite3"
    db = connect(db_path)
    for sid in ids:
        apply(db, events(sid))
    async with client(db_path) as http:
        listing = (await http.get("/sessions")).text
        for sid in ids:
            href = re.search(rf'<a href="([^"]+)">{re.escape(html.escape(sid))}</a>', listing)
            assert href is not None, sid
            page = await http.get(html.unescape(href.group(1)))
            assert page.status_code == 200 and f"<title>Session {html.escape(sid)} " in page.text, (sid, href)
            turn = re.search(r'<a href="(/turns/[^"]+)">1</a>', page.text)
            assert turn is not None, sid
            opened = await http.get(html.unescape(turn.group(1)))
            assert opened.status_code == 200 and html.escape(sid) in opened.text, (sid, turn.group(1))

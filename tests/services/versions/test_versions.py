"""``turnstream versions`` as a user runs it, against the real broker: the listing folds ``versions`` beside
``evals`` and ``weights``; promote, rollback, pin and unpin are events on ``versions`` that replay to the same
served version; impossible decisions are refused with the reason and write nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from runtime.configuration.config import KafkaConfig
from runtime.messaging.bus import EventProducer, read_topic
from runtime.pipeline.promotion import fold
from schemas import EvalAnswer, EvalResult, VersionDecision, WeightsPublished
from schemas.topics import EVALS, VERSIONS, WEIGHTS
from services.versions.main import VersionsError, listing, manual

pytestmark = pytest.mark.integration


def versions(kafka: KafkaConfig, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "services.cli", "versions", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={
            **os.environ,
            "TURNSTREAM_LOGGING_FORMAT": "text",
            **kafka.client_env(),
        },
    )


def held_out(version: int, met: bool) -> EvalResult:
    answers = [EvalAnswer("q", "a", {"plain-short": met}), EvalAnswer("q2", "a", {"plain-short": True})]
    return EvalResult(
        version=version,
        question_set="heldout-16-abc",
        answers=answers,
        scores={"plain-short": (1 + met) / 2},
        model="smollm2",
        evaluated_at=time.time(),
    )


async def test_manual_decisions_are_events_that_replay_to_the_served_version(kafka: KafkaConfig) -> None:
    async with EventProducer(kafka) as producer:
        for v in (1, 2, 3):
            w = WeightsPublished(
                version=v,
                path=f"/w/v{v}",
                base_model="smollm2",
                step=v,
                created_at=time.time(),
                figures={"kl": v / 100},
            )
            await producer.send(WEIGHTS, w, "policy")
        await producer.send(EVALS, held_out(0, True), "0")
        await producer.send(EVALS, held_out(2, False), "2")
    assert versions(kafka, "promote", "2").returncode == 0
    assert versions(kafka, "promote", "3").returncode == 0
    pinned = versions(kafka, "pin", "2")
    assert pinned.returncode == 0 and json.loads(pinned.stdout)["state"] == "pinned"
    shown = json.loads(versions(kafka, "list", "--json").stdout)
    assert (shown["promoted"], shown["serving"], shown["pinned"]) == (3, 2, 2)
    rows = {r["version"]: r for r in shown["versions"]}
    assert (
        rows[2]["scores"] == {"heldout-16-abc": {"plain-short": 0.5, "overall": 0.5}} and rows[2]["serving"]
    )
    assert rows[3]["figures"] == {"kl": 0.03}  # the newest announcement (weights keeps the newest only)
    assert rows[1]["state"] == "published"
    assert versions(kafka, "unpin").returncode == 0
    back = versions(kafka, "rollback")
    assert back.returncode == 0 and json.loads(back.stdout)["against"] == 2
    text = versions(kafka).stdout  # the table, as people read it
    assert text.splitlines()[0].startswith("serving version 2 (promoted 2)")
    # Refused, naming why, and nothing written.
    before = [r.event async for r in read_topic(kafka, VERSIONS)]
    unknown = versions(kafka, "promote", "9")
    assert unknown.returncode == 2 and "version 9 is unknown" in unknown.stderr
    assert versions(kafka, "unpin").returncode == 2
    after: list[VersionDecision] = [r.event async for r in read_topic(kafka, VERSIONS)]
    assert after == before and [d.state for d in after] == [
        "promoted",
        "promoted",
        "pinned",
        "unpinned",
        "rolled_back",
    ]
    # The decisions replay: whoever reads the topic serves what the command said.
    assert fold(after).serving == 2 and all(d.by == "manual" for d in after)


def test_what_cannot_be_decided_is_refused() -> None:
    p = fold([])
    with pytest.raises(VersionsError, match="cannot be rolled back"):
        manual(p, {0}, "rollback", None)
    with pytest.raises(VersionsError, match="is not promoted"):
        manual(p, {0, 1}, "rollback", 1)
    with pytest.raises(VersionsError, match="nothing is pinned"):
        manual(p, {0}, "unpin", None)
    assert manual(p, {0, 1}, "promote", 1).against == 0


def test_the_listing_shows_every_version_once_with_its_latest_state() -> None:
    d = [
        VersionDecision(
            version=1, state="candidate", reason="published", by="gate", decided_at=0.0, figures={"kl": 0.1}
        ),
        VersionDecision(version=1, state="rejected", reason="plain-short fell", by="gate", decided_at=1.0),
    ]
    shown = listing(d, [held_out(1, False)], [])
    assert [(r.version, r.state, r.reason) for r in shown.versions] == [
        (0, "promoted", ""),
        (1, "rejected", "plain-short fell"),
    ]
    assert shown.versions[1].figures == {"kl": 0.1} and shown.failed_streak == 1

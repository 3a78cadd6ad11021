"""``turnstream versions``: every weight version with its state, gate results and figures, and the decisions a person
makes by hand (``promote N``, ``rollback [N]``, ``pin N``, ``unpin``), each an event on ``versions``.

The table is the fold of ``versions`` (``runtime/pipeline/promotion.py``) beside ``evals`` (each version's scores per
question set) and the newest ``weights`` announcement. A manual decision names a version that exists (announced,
decided or evaluated) and says what it changes; the reloaders and the trainer act on it from the topic.
"""

from __future__ import annotations

import time

import msgspec

from runtime.configuration.config import Config
from runtime.messaging.bus import EventProducer, read_topic
from runtime.pipeline.promotion import Promotion, fold
from schemas import EvalResult, VersionDecision, WeightsPublished
from schemas.topics import EVALS, VERSIONS, WEIGHTS


class VersionsError(ValueError):
    """A manual decision that cannot be made (unknown version, nothing to roll back, ...)."""


class VersionRow(msgspec.Struct):
    version: int
    state: str
    serving: bool
    scores: dict[str, dict[str, float]]
    """Question set -> score name -> score (``overall`` included)."""
    figures: dict[str, float]
    reason: str
    by: str


class Listing(msgspec.Struct):
    promoted: int
    serving: int
    pinned: int | None
    failed_streak: int
    versions: list[VersionRow]


async def history(config: Config) -> tuple[list[VersionDecision], list[EvalResult], list[WeightsPublished]]:
    decisions = [r.event async for r in read_topic(config.kafka, VERSIONS)]
    evals = [r.event async for r in read_topic(config.kafka, EVALS)]
    weights = [r.event async for r in read_topic(config.kafka, WEIGHTS)]
    return decisions, evals, weights


def listing(
    decisions: list[VersionDecision], evals: list[EvalResult], weights: list[WeightsPublished]
) -> Listing:
    p = fold(decisions)
    last: dict[int, VersionDecision] = {}
    figures: dict[int, dict[str, float]] = {}
    for d in decisions:
        if d.state not in ("pinned", "unpinned", "restored"):
            last[d.version] = d
        if d.figures:
            figures[d.version] = d.figures
    for w in weights:
        figures.setdefault(w.version, w.figures)
    scores: dict[int, dict[str, dict[str, float]]] = {}
    for e in evals:
        scores.setdefault(e.version, {})[e.question_set] = {**e.scores, "overall": e.overall}
    versions = sorted({0} | set(last) | set(figures) | set(scores) | set(p.states))
    rows = [
        VersionRow(
            version=v,
            state=p.state(v) if v in p.states or v == 0 else "published",
            serving=v == p.serving,
            scores=scores.get(v, {}),
            figures=figures.get(v, {}),
            reason=last[v].reason if v in last else "",
            by=last[v].by if v in last else "",
        )
        for v in versions
    ]
    return Listing(p.promoted, p.serving, p.pinned, p.failed_streak, rows)


def manual(p: Promotion, known: set[int], action: str, version: int | None) -> VersionDecision:
    """The decision ``turnstream versions ACTION [N]`` makes, or a VersionsError saying why it cannot."""
    now = time.time()
    if action == "unpin":
        if p.pinned is None:
            raise VersionsError("nothing is pinned")
        return VersionDecision(
            version=p.pinned, state="unpinned", reason="unpinned by hand", by="manual", decided_at=now
        )
    if action == "rollback":
        target = p.promoted if version is None else version
        if target == 0:
            raise VersionsError("the starting weights (version 0) cannot be rolled back")
        if target not in p.history:
            raise VersionsError(f"version {target} is not promoted (promoted: {p.history})")
        before = p.history[p.history.index(target) - 1] if p.history.index(target) > 0 else 0
        return VersionDecision(
            version=target,
            state="rolled_back",
            reason=f"rolled back by hand; version {before} is promoted again",
            by="manual",
            decided_at=now,
            against=before,
        )
    assert version is not None
    if version not in known:
        raise VersionsError(f"version {version} is unknown (known: {sorted(known)[-10:]})")
    if action == "promote":
        return VersionDecision(
            version=version,
            state="promoted",
            reason="promoted by hand",
            by="manual",
            decided_at=now,
            against=p.promoted,
        )
    if action == "pin":
        return VersionDecision(
            version=version, state="pinned", reason="serving pinned by hand", by="manual", decided_at=now
        )
    raise VersionsError(f"unknown action {action!r}")


async def decide(config: Config, action: str, version: int | None) -> VersionDecision:
    decisions, evals, weights = await history(config)
    p = fold(decisions)
    known = {0} | {d.version for d in decisions} | {e.version for e in evals}
    known |= set(range(1, max((w.version for w in weights), default=0) + 1))
    decision = manual(p, known, action, version)
    async with EventProducer(config.kafka, client_id=f"{config.kafka.client_id}-versions") as producer:
        await producer.send(VERSIONS, decision, "policy")
    return decision


def table(shown: Listing) -> str:
    """The listing as people read it: one line per version, newest last."""
    pinned = f", pinned at {shown.pinned}" if shown.pinned is not None else ""
    lines = [
        f"serving version {shown.serving} (promoted {shown.promoted}{pinned});"
        f" {shown.failed_streak} failed candidate(s) in a row",
        f"{'version':>7}  {'state':<11}  {'held-out':>8}  {'sets':>5}  {'kl':>8}  reason",
    ]
    for r in shown.versions:
        held = next((s["overall"] for q, s in r.scores.items() if q.startswith("heldout-")), None)
        kl = r.figures.get("kl", r.figures.get("kl_rollout"))
        lines.append(
            f"{r.version:>7}{'*' if r.serving else ' '} {r.state:<11}  "
            f"{'' if held is None else f'{held:.0%}':>8}  {sum(1 for q in r.scores if q.startswith('set-')):>5}  "
            f"{'' if kl is None else f'{kl:.4f}':>8}  {r.reason}"
        )
    return "\n".join(lines)

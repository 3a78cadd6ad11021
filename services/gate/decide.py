"""What the gate decides next, from everything it has read: the weight announcements, the evaluations and the
decisions already on ``versions``. Pure and idempotent (a restart that reads the same history decides nothing
twice): the worker feeds it events and sends what ``pending`` returns.

- A newly announced version becomes a ``candidate`` (its trainer figures copied, since ``weights`` keeps only the
  newest announcement).
- The newest candidate with its evaluations in is judged, and older ones still undecided are then ``superseded``
  (neither promoted nor counted as a failure); newer ones wait for theirs. (Superseding older candidates as soon
  as a newer one was announced starved the gate whenever steps came faster than an evaluation: in a measured run
  every version after the third was superseded unjudged, while serve-then-check served each of them.)
  A candidate older than the promoted version (one promoted by hand while it waited) is superseded too.
- A candidate is judged once the candidate and the promoted version both have a result on every required set
  (``services/gate/policy.py``): ``promoted`` when it passes; when it fails, ``rejected`` (mechanism ``adapter``:
  no user saw it) or ``rolled_back`` (``serve-then-check``: it was served while evaluated).
"""

from __future__ import annotations

import time

from schemas import EvalResult, VersionCheck, VersionDecision, WeightsPublished
from services.config import GateConfig
from services.gate.policy import verdict
from services.promotion import Promotion

DECIDED = frozenset({"promoted", "rejected", "rolled_back", "superseded"})


class GateState:
    def __init__(self, gc: GateConfig, required: list[str], heldout: str | None) -> None:
        self.gc = gc
        self.required = required
        """The question set ids a candidate must be evaluated on (the held-out set's first when gated)."""
        self.heldout = heldout
        self.promotion = Promotion()
        self.results: dict[int, dict[str, EvalResult]] = {}
        self.announced: dict[int, WeightsPublished] = {}
        self.figures: dict[int, dict[str, float]] = {}

    def decided(self, d: VersionDecision) -> None:
        self.promotion.apply(d)
        if d.figures:
            self.figures[d.version] = d.figures

    def evaluated(self, r: EvalResult) -> None:
        self.results.setdefault(r.version, {})[r.question_set] = r

    def published(self, w: WeightsPublished) -> None:
        self.announced[w.version] = w

    def _state(self, version: int) -> str | None:
        return self.promotion.states.get(version)

    def pending(self, now: float | None = None) -> list[VersionDecision]:
        """The decisions due now (apply each with ``decided`` once it is sent)."""
        now = time.time() if now is None else now
        out: list[VersionDecision] = []
        for v in sorted(self.announced):
            if self._state(v) is None:
                w = self.announced[v]
                out.append(
                    VersionDecision(
                        version=v,
                        state="candidate",
                        reason="published by the trainer",
                        by="gate",
                        decided_at=now,
                        figures=w.figures,
                        path=w.path,
                    )
                )
        for d in out:
            self.decided(d)
        candidates = sorted((v for v, s in self.promotion.states.items() if s == "candidate"), reverse=True)
        promoted = self.promotion.promoted
        for v in [c for c in candidates if c < promoted]:  # a newer one was promoted (by hand) first
            d = VersionDecision(
                version=v,
                state="superseded",
                reason=f"version {promoted} was promoted before this one was judged",
                by="gate",
                decided_at=now,
            )
            self.decided(d)
            out.append(d)
        candidates = [c for c in candidates if c > promoted]
        for v in candidates:  # the newest that can be judged; newer ones wait for their evaluations
            judged = self.judge(v, now)
            if judged is None:
                continue
            self.decided(judged)
            out.append(judged)
            for older in sorted(c for c in candidates if c < v):
                d = VersionDecision(
                    version=older,
                    state="superseded",
                    reason=f"version {v} was judged before this one",
                    by="gate",
                    decided_at=now,
                )
                self.decided(d)
                out.append(d)
            break
        return out

    def judge(self, version: int, now: float) -> VersionDecision | None:
        promoted = self.promotion.promoted
        v = verdict(
            self.gc,
            self.required,
            self.results.get(version, {}),
            self.results.get(promoted, {}),
            self.figures.get(version, {}),
            self.heldout,
        )
        if v.passed is None:
            return None
        checks = [VersionCheck(c.name, c.value, c.bound, c.passed, c.at_most) for c in v.checks]
        if v.passed:
            state = "promoted"
        else:
            state = "rejected" if self.gc.mechanism == "adapter" else "rolled_back"
        return VersionDecision(
            version=version,
            state=state,
            reason=v.reason(),
            by="gate",
            decided_at=now,
            checks=checks,
            against=promoted,
        )

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
- Under ``serve-then-check`` (users are served each candidate while it is checked) one version is a candidate at
  a time: the newest announced becomes one once the one before was judged, older announced ones are superseded
  untried, and after a rollback the next is tried only when users have been back on the promoted version long
  enough that the failed candidate had at most ``gate.candidate_share`` of the time since it was tried (a trainer
  that publishes faster than a check otherwise keeps users on untested weights nearly all the time). A candidate
  without a verdict ``gate.check_timeout_s`` after it was tried (its weights could not be loaded, say) is
  superseded once a newer version waits, so the gate never stalls on it.
- A candidate is judged once the candidate and the promoted version both have a result on every required set
  (``services/gate/policy.py``): ``promoted`` when it passes; when it fails, ``rejected`` (mechanism ``adapter``:
  no user saw it) or ``rolled_back`` (``serve-then-check``: it was served while evaluated).
"""

from __future__ import annotations

import time

from runtime.configuration.config import GateConfig
from runtime.pipeline.promotion import Promotion
from schemas import EvalResult, VersionCheck, VersionDecision, WeightsPublished
from services.gate.policy import verdict

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
        self.tried_at: dict[int, float] = {}
        """When each version became a candidate."""
        self.last_failure: tuple[float, float] | None = None
        """(tried, rolled back) of the gate's latest verdict when it was a rollback: the next try waits for it."""

    def decided(self, d: VersionDecision) -> None:
        self.promotion.apply(d)
        if d.figures:
            self.figures[d.version] = d.figures
        if d.state == "candidate":
            self.tried_at[d.version] = d.decided_at
        elif d.by == "gate" and d.state == "rolled_back":
            self.last_failure = (self.tried_at.get(d.version, d.decided_at), d.decided_at)
        elif d.by == "gate" and d.state in ("promoted", "rejected"):
            self.last_failure = None

    def next_try_at(self) -> float:
        """``serve-then-check``: the earliest time the next candidate may be served."""
        if self.last_failure is None:
            return float("-inf")
        tried, failed = self.last_failure
        return failed + (failed - tried) * (1.0 / self.gc.candidate_share - 1.0)

    def _announce(self, now: float) -> list[VersionDecision]:
        """The newly announced versions that become candidates now (and, under ``serve-then-check``, the older
        ones superseded untried)."""
        new = [v for v in sorted(self.announced) if self._state(v) is None]
        if self.gc.mechanism != "serve-then-check":
            return [self._candidate(v, now) for v in new]
        promoted = self.promotion.promoted
        trying = [v for v, s in self.promotion.states.items() if s == "candidate" and v > promoted]
        if not new:
            return []
        timeout = self.gc.check_timeout_s
        stale = [
            self._superseded(v, f"no verdict within {timeout:g} s of being tried (never evaluated?)", now)
            for v in trying
            if now - self.tried_at.get(v, now) > timeout
        ]
        older = [v for v in new if v <= promoted]  # announced after a newer one was promoted (by hand)
        new = [v for v in new if v > promoted]
        out = stale + [
            self._superseded(v, f"version {promoted} was promoted before it was tried", now) for v in older
        ]
        if not new or len(stale) < len(trying) or now < self.next_try_at():
            return out
        newest = new[-1]
        passed = [self._superseded(v, f"version {newest} was tried before this one", now) for v in new[:-1]]
        return [self._candidate(newest, now), *out, *passed]

    @staticmethod
    def _superseded(v: int, reason: str, now: float) -> VersionDecision:
        return VersionDecision(version=v, state="superseded", reason=reason, by="gate", decided_at=now)

    def _candidate(self, v: int, now: float) -> VersionDecision:
        w = self.announced[v]
        return VersionDecision(
            version=v,
            state="candidate",
            reason="published by the trainer",
            by="gate",
            decided_at=now,
            figures=w.figures,
            path=w.path,
        )

    def evaluated(self, r: EvalResult) -> None:
        self.results.setdefault(r.version, {})[r.question_set] = r

    def published(self, w: WeightsPublished) -> None:
        self.announced[w.version] = w

    def _state(self, version: int) -> str | None:
        return self.promotion.states.get(version)

    def pending(self, now: float | None = None) -> list[VersionDecision]:
        """The decisions due now (apply each with ``decided`` once it is sent)."""
        now = time.time() if now is None else now
        out = self._announce(now)
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

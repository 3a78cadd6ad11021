"""Which weight version users are served under a gate: the fold of every ``VersionDecision`` on ``versions``.

Shared runtime, so that the proxy's reloader (what to load), the trainer (when to restore), ``turnstream
versions`` and the console read the same history the same way. The starting weights (version 0) are promoted
until a decision says otherwise; a rollback serves the version promoted before the one taken back; a pin freezes
serving at its version until it is unpinned, whatever is promoted meanwhile.
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

from schemas import VersionDecision


class Promotion(msgspec.Struct):
    history: list[int] = msgspec.field(default_factory=lambda: [0])
    """The promoted versions in order, those rolled back taken out: the last is the promoted one."""
    pinned: int | None = None
    states: dict[int, str] = msgspec.field(default_factory=dict)
    """Each version's latest state (``VERSION_STATES``); 0 is promoted until decided otherwise."""
    failed_streak: int = 0
    """Candidates rejected or rolled back by the gate since the last promotion or restore: the trainer restores
    the promoted version when this reaches ``gate.restore_after``."""
    decisions: int = 0

    @property
    def promoted(self) -> int:
        return self.history[-1] if self.history else 0

    @property
    def serving(self) -> int:
        """What users are served: the pinned version, else the promoted one."""
        return self.pinned if self.pinned is not None else self.promoted

    def state(self, version: int) -> str:
        if version in self.states:
            return self.states[version]
        return "promoted" if version == 0 else "unknown"

    def apply(self, d: VersionDecision) -> None:
        self.decisions += 1
        v = d.version
        if d.state == "pinned":
            self.pinned = v
            return
        if d.state == "unpinned":
            self.pinned = None
            return
        if d.state == "restored":
            self.failed_streak = 0
            return
        self.states[v] = d.state
        if d.state == "promoted":
            if v in self.history:
                self.history.remove(v)
            self.history.append(v)
            self.failed_streak = 0
        elif d.state in ("rejected", "rolled_back"):
            if v in self.history:
                self.history.remove(v)
            if d.by == "gate":
                self.failed_streak += 1


def fold(decisions: Iterable[VersionDecision]) -> Promotion:
    p = Promotion()
    for d in decisions:
        p.apply(d)
    return p

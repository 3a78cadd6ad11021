"""One person's share of a training step (``trainer.max_user_share``).

One policy learns from everyone, so whoever sends the most samples would steer it for all: a step is filled in
rounds, one sample of each user with samples waiting per round (the user whose oldest waits longest first), and no
user gives a step more than ``ceil(max_user_share * rollout_batch_size)`` of its samples. The rest of theirs wait
for a later step: deferred, never dropped. Two cases lift the cap for a step, each counted: no other user has sent
a sample for ``trainer.user_share_wait_s`` (a deployment of one person: nobody else's share to protect; a flood
does not get whole steps in the moment between two others' samples), or the oldest sample has waited that long
without others arriving to fill the step (training never stalls behind the cap).

A sample's user is its session's owner: the id before ``/`` in a session recorded under per-user keys
(``alice/s1``); sessions of the shared key are ``default``'s.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from schemas import OWNER_SEPARATOR

SHARED_USER = "default"
"""The user of a session recorded without an owner (the shared key's)."""


def user_of(session_id: str) -> str:
    owner, separator, _ = session_id.partition(OWNER_SEPARATOR)
    return owner if separator and owner else SHARED_USER


@dataclass(frozen=True)
class Choice:
    """The positions (into the waiting samples, ascending: trained in arrival order) of one step's samples."""

    chosen: list[int]
    deferred: int
    """Samples that arrived before the step's last one and were left for later by the cap."""
    lifted: str = ""
    """Why the cap did not hold for this step: ``alone`` (one user waiting) or ``waited``; empty when it held."""

    def figures(self, users: Sequence[str]) -> dict[str, float]:
        """The step's share figures for its announcement (``WeightsPublished.figures``, the console's columns)."""
        counts: dict[str, int] = {}
        for i in self.chosen:
            counts[users[i]] = counts.get(users[i], 0) + 1
        return {
            "users": float(len(counts)),
            "top_user_share": max(counts.values()) / len(self.chosen),
            "deferred_by_share": float(self.deferred),
        }


def cap(share: float, batch: int) -> int:
    """The most samples one user may give a step of ``batch``."""
    return max(1, math.ceil(share * batch - 1e-9))


def choose(
    users: Sequence[str], waited_s: float, active: int, batch: int, share: float, wait_s: float
) -> Choice | None:
    """One step's samples out of those waiting (``users``: each one's user, in arrival order; ``waited_s``: how
    long the oldest has waited; ``active``: the users who sent a sample within ``wait_s``, these included), or
    None when the step must wait for more."""
    if len(users) < batch:
        return None
    if share >= 1 or active <= 1:
        return Choice(list(range(batch)), 0, "" if share >= 1 else "alone")
    chosen = _rounds(users, batch, cap(share, batch))
    if len(chosen) < batch:
        if waited_s < wait_s:
            return None
        taken = set(chosen)
        chosen += [i for i in range(len(users)) if i not in taken][: batch - len(chosen)]
        return Choice(sorted(chosen), _skipped(chosen), "waited")
    return Choice(sorted(chosen), _skipped(chosen))


def _rounds(users: Sequence[str], batch: int, most: int) -> list[int]:
    queues: dict[str, list[int]] = {}
    for i, user in enumerate(users):  # dicts keep insertion order: users by their oldest sample
        queues.setdefault(user, []).append(i)
    chosen: list[int] = []
    for depth in range(most):
        for queue in queues.values():
            if depth < len(queue) and len(chosen) < batch:
                chosen.append(queue[depth])
    return chosen


def _skipped(chosen: list[int]) -> int:
    return max(chosen) + 1 - len(chosen)

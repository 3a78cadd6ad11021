"""How far a sample's weights are from the trainer's: counted in steps along the lineage, not in version numbers.

Version numbers only grow, but after a restore (under a gate) the trainer trains on from an earlier version: v6
trained from a restored v1 is one step from v1, not five. Counted by number, every sample of the users still
served v1 was "stale" for good, and the trainer starved (measured: a LoRA run under the ``adapter`` gate stopped
at v6 with 183 samples dropped). The lineage is what the trainer recorded (each step's parent), through the
checkpoint's ``ancestors`` across restarts; where it is unknown, the numbers are the best guess left.
"""

from __future__ import annotations

from collections.abc import Mapping
from itertools import pairwise

ANCESTORS_KEPT = 64
"""How many versions behind its weights a checkpoint records: staleness beyond this is not told apart."""


def steps_apart(parents: Mapping[int, int], at: int, other: int) -> int:
    """Training steps between version ``other``'s weights and version ``at``'s: up from each to their nearest
    common ancestor along ``parents`` (version -> the version it was trained from); ``at - other`` (at least 0)
    where the lineage does not connect them."""
    depth: dict[int, int] = {}
    v, d = at, 0
    while True:
        depth[v] = d
        if v not in parents:
            break
        v, d = parents[v], d + 1
    v, d = other, 0
    while v not in depth:
        if v not in parents:
            return max(at - other, 0)
        v, d = parents[v], d + 1
    return depth[v] + d


def ancestors(parents: Mapping[int, int], at: int, limit: int = ANCESTORS_KEPT) -> list[int]:
    """The versions behind ``at``, nearest first (what a checkpoint records)."""
    out: list[int] = []
    v = at
    while v in parents and len(out) < limit:
        v = parents[v]
        out.append(v)
    return out


def from_ancestors(at: int, behind: list[int]) -> dict[int, int]:
    """The parents that a checkpoint's ``ancestors`` list says."""
    chain = [at, *behind]
    return dict(pairwise(chain))

"""Staleness in steps along the trainer's lineage (services/trainer/staleness.py)."""

from __future__ import annotations

from services.trainer.staleness import ancestors, from_ancestors, steps_apart

# v1..v5 trained in a row, then restored to v1 and v6, v7 trained from it.
PARENTS = {1: 0, 2: 1, 3: 2, 4: 3, 5: 4, 6: 1, 7: 6}


def test_steps_along_the_lineage_not_version_numbers() -> None:
    assert steps_apart(PARENTS, 6, 1) == 1
    assert steps_apart(PARENTS, 7, 1) == 2
    assert steps_apart(PARENTS, 7, 0) == 3
    assert steps_apart(PARENTS, 7, 7) == 0


def test_a_discarded_branch_is_as_far_as_the_steps_through_their_common_ancestor() -> None:
    assert steps_apart(PARENTS, 7, 5) == 2 + 4
    assert (
        steps_apart(PARENTS, 1, 5) == 4
    )  # just restored to v1: v5's samples are four steps off, not "newer"


def test_without_a_lineage_the_numbers_are_the_guess() -> None:
    assert steps_apart({}, 6, 3) == 3
    assert steps_apart({}, 3, 6) == 0
    assert steps_apart({7: 6}, 7, 2) == 5


def test_a_checkpoint_records_the_versions_behind_it_and_gives_them_back() -> None:
    behind = ancestors(PARENTS, 7)
    assert behind == [6, 1, 0]
    assert ancestors(PARENTS, 7, limit=2) == [6, 1]
    assert from_ancestors(7, behind) == {7: 6, 6: 1, 1: 0}
    assert steps_apart(from_ancestors(7, behind), 7, 1) == 2

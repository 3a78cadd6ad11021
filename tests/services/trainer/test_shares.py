"""One person's share of a step (``trainer.max_user_share``): filled in rounds over the users waiting, none past
the cap, the rest deferred in order; lifted only for one user alone or after ``user_share_wait_s``."""

from __future__ import annotations

from services.trainer.shares import cap, choose, user_of


def test_a_flood_from_one_user_gives_each_step_its_share_and_waits_for_the_rest() -> None:
    users = ["mallory"] * 40 + ["alice", "bob", "carol", "dave"] * 3  # arrival order: the flood first
    choice = choose(users, waited_s=0.0, active=5, batch=16, share=0.25, wait_s=300)
    assert choice is not None and not choice.lifted
    picked = [users[i] for i in choice.chosen]
    assert picked.count("mallory") == cap(0.25, 16) == 4 and len(picked) == 16
    assert choice.chosen == sorted(choice.chosen)  # trained in arrival order
    assert choice.chosen[:4] == [0, 1, 2, 3], "the flood's oldest go first; the rest wait"
    assert choice.deferred == 36  # mallory's 5..40 arrived before the step's last sample
    figures = choice.figures(users)
    assert figures == {"users": 5.0, "top_user_share": 0.25, "deferred_by_share": 36.0}


def test_a_step_that_the_cap_cannot_fill_waits_then_takes_the_deferred_oldest_first() -> None:
    users = ["mallory"] * 20 + ["alice"] * 2
    assert choose(users, waited_s=299.0, active=2, batch=16, share=0.25, wait_s=300) is None
    late = choose(users, waited_s=300.0, active=2, batch=16, share=0.25, wait_s=300)
    assert late is not None and late.lifted == "waited"
    assert [users[i] for i in late.chosen].count("alice") == 2 and late.chosen[:14] == list(range(14))


def test_one_user_alone_and_a_cap_of_one_take_arrival_order() -> None:
    alone = choose(["default"] * 20, waited_s=0.0, active=1, batch=16, share=0.25, wait_s=300)
    assert alone is not None and alone.chosen == list(range(16)) and alone.lifted == "alone"
    # others sent samples lately (all trained): the flood waiting alone still gets its share, no more
    assert choose(["mallory"] * 20, waited_s=0.0, active=3, batch=16, share=0.25, wait_s=300) is None
    off = choose(["a"] * 10 + ["b"] * 10, waited_s=0.0, active=2, batch=16, share=1.0, wait_s=300)
    assert off is not None and off.chosen == list(range(16)) and not off.lifted
    too_few = choose(["a", "b"], waited_s=1e9, active=2, batch=16, share=0.25, wait_s=300)
    assert too_few is None  # not enough to fill a step, however long they waited
    assert cap(0.25, 2) == 1 and cap(0.01, 16) == 1 and cap(0.5, 16) == 8


def test_a_samples_user_is_its_sessions_owner() -> None:
    assert user_of("alice/s1") == "alice" and user_of("alice/a/b") == "alice"
    assert user_of("s1") == user_of("/s1") == "default"

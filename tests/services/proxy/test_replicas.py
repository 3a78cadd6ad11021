"""Routing between policy replicas on its own (services/proxy/replicas.py): sessions stay where their prefix is
cached, leave an overloaded replica, new ones go to the least loaded, and only replicas on the right version that
answer take traffic. The same routing against two real SGLang servers is in test_replica_serving.py."""

from __future__ import annotations

from typing import Any

import pytest

from runtime.configuration.config import EngineConfig, replica_name
from runtime.engine.client import EngineClient
from services.proxy.replicas import Replica, Router, cost, first_choice, opening_key, routing_secret
from tests.services.proxy.conftest import spread_sessions


class Wanting:
    """A reloader as the router sees it: which version its replica should serve."""

    def __init__(self, version: int) -> None:
        self.version = version

    def serves_wanted(self, serving: int) -> bool:
        return serving >= self.version


def replicas(n: int) -> list[Replica]:
    return [
        Replica(f"h{i}:30000", f"http://h{i}:30000", EngineClient(f"http://h{i}:30000")) for i in range(n)
    ]


def test_a_session_stays_on_its_replica_and_new_ones_go_to_the_least_loaded() -> None:
    a, b = replicas(2)
    router = Router([a, b])
    first = router.pick("s1")
    assert first is not None
    first.begin()  # s1's turn is in flight there: the next new session goes to the other one
    second = router.pick("s2")
    assert second is not None and second is not first
    for _ in range(3):  # within the overload margin, s1 keeps its replica
        assert router.pick("s1") is first
        first.begin()
    assert first.in_flight == 4 and second.in_flight == 0


SECRET = routing_secret(None, "the-engine-admin-key-0123456789")


def test_idle_replicas_take_new_sessions_where_the_shared_hash_says_and_tests_can_ask_it() -> None:
    """Equally loaded, a new session goes to ``first_choice`` (what every proxy with the same routing key computes
    alike); the tests that need users on every replica choose their session ids with it (``spread_sessions``)."""
    pool = replicas(3)
    names = [r.name for r in pool]
    router = Router(pool, secret=SECRET)
    chosen = {key: router.pick(key) for key in (f"k{i}" for i in range(60))}
    assert all(r is not None and r.name == first_choice(key, names, SECRET) for key, r in chosen.items())
    assert len({r.name for r in chosen.values() if r is not None}) == 3  # the hash spreads them
    spread = spread_sessions("t", names, 2, SECRET)
    assert len(spread) == 6 and sorted(first_choice(s, names, SECRET) for s in spread) == sorted(names * 2)
    assert [Router(replicas(3), secret=SECRET).pick(s).name for s in spread] == [  # type: ignore[union-attr]
        first_choice(s, names, SECRET) for s in spread
    ]


def test_a_client_cannot_choose_session_ids_that_all_land_on_one_replica() -> None:
    """Issue 55, row 4: with the routing hash public, 12 session ids chosen by it all went to one replica (and
    stayed there: affinity). Keyed with a secret the deployment holds and clients do not (``routing_secret``: the
    engine's keys, or ``proxy.routing_secret``), the same ids spread."""
    names = [r.name for r in replicas(3)]
    chosen = [s for s in (f"attack-{i}" for i in range(200)) if first_choice(s, names) == names[0]][:12]
    assert len(chosen) == 12
    for secret, replicas_used in ((b"", 1), (SECRET, 3)):
        router = Router(replicas(3), secret=secret)
        landed = {router.pick(s).name for s in chosen}  # type: ignore[union-attr]
        assert len(landed) == replicas_used, (secret, landed)
    assert routing_secret(None, None, None) == b"" and routing_secret("own", "admin") == routing_secret("own")


def test_new_sessions_go_where_the_fewest_tokens_are_in_flight() -> None:
    """Issue 55, row 4: load counted in requests sent a new session to a replica working on one 200 KB prompt
    rather than to one with two short questions. Counted in tokens (``cost``: bytes / 4 plus ``max_tokens``)."""
    big, small = replicas(2)
    router = Router([big, small], secret=SECRET)
    big.begin(cost(200_000, {"max_tokens": 256}))
    for _ in range(2):
        small.begin(cost(300, {"max_tokens": 256}))
    assert router.pick("fresh") is small
    big.end(cost(200_000, {"max_tokens": 256}))
    assert big.tokens == 0 and small.tokens == 2 * (75 + 256) and router.pick("fresh-2") is big


def test_an_overloaded_replica_gives_its_session_to_the_least_loaded_for_good() -> None:
    a, b = replicas(2)
    router = Router([a, b], overload_abs=2, overload_rel=1.5)
    home = router.pick("s")
    assert home is not None
    other = b if home is a else a
    home.begin()
    assert router.pick("s") is home  # 1 against 0: not overloaded (needs 2 more)
    home.begin()
    assert router.pick("s") is other  # 2 against 0
    home.end()
    home.end()
    assert router.pick("s") is other  # stays where it moved: its prefix is cached there now


def test_round_robin_takes_turns_whatever_the_session() -> None:
    a, b, c = replicas(3)
    router = Router([a, b, c], "round_robin")
    assert [router.pick("s") for _ in range(6)] == [a, b, c, a, b, c]


def test_only_replicas_on_the_wanted_version_take_traffic_while_any_is() -> None:
    a, b = replicas(2)
    a.reloader, b.reloader = Wanting(3), Wanting(3)
    a.versions.changed(3)  # b restarted on its starting weights: not until it has loaded version 3
    router = Router([a, b])
    assert {router.pick(f"s{i}") for i in range(8)} == {a}
    assert router.pick(None) is a
    b.versions.changed(3)
    assert {router.pick(f"t{i}") for i in range(8)} == {a, b}
    a.reloader.version = b.reloader.version = 4  # both loading the next: served by those that answer
    assert {router.pick(f"u{i}") for i in range(8)} == {a, b}


def test_a_replica_that_gives_no_answer_is_skipped_then_tried_again() -> None:
    a, b = replicas(2)
    router = Router([a, b])
    home = router.pick("s")
    assert home is not None
    home.refused()
    other = router.pick("s")
    assert other is not None and other is not home
    assert router.pick("s", exclude=[other]) is home  # nothing else left: still offered
    home.down_until = 0.0
    home.versions.reachable = False  # its probe failed too
    assert router.pick("x") is other
    assert router.pick("x", exclude=[a, b]) is None


@pytest.mark.parametrize(
    ("body", "same"),
    [
        ({"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}]}, True),
        (
            {
                "messages": [
                    {"role": "system", "content": "S"},
                    {"role": "user", "content": "hi"},
                    {"role": "assistant", "content": "hello"},
                    {"role": "user", "content": "more"},
                ]
            },
            True,
        ),
        ({"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "other"}]}, False),
    ],
)
def test_a_conversations_turns_share_its_opening_key(body: dict[str, Any], same: bool) -> None:
    opening = {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}]}
    assert (opening_key(body) == opening_key(opening)) is same


def test_replicas_are_named_by_host_and_port_and_must_differ() -> None:
    assert replica_name("http://sglang-policy-2:30000/") == "sglang-policy-2:30000"
    assert EngineConfig(replicas=["http://a:1", "http://b:1"]).urls == ["http://a:1", "http://b:1"]
    assert EngineConfig().urls == ["http://127.0.0.1:30000"]
    with pytest.raises(ValueError, match="different host:port"):
        EngineConfig(replicas=["http://a:1", "http://a:1/v1"])

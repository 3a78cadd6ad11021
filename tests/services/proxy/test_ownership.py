"""Issue 42, finding 1: with per-user keys a session is its user's alone, whoever named it. A session the proxy
inferred used to have no owner: another user who learnt its ``anon-...`` id wrote turns into it, ended it and
then locked its rightful user out with a 403; ids not yet used could be squatted, and 403-versus-200 told anyone
which ids existed. Now every id lives in its user's namespace (``alice/anon-...``), so the same id from another
key is another session: served, recorded apart, and telling nothing. Real Kafka and Redis, the stub engine."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from runtime.configuration.config import KafkaConfig, RedisConfig
from schemas import SessionEnded
from schemas.topics import SESSIONS_ENDED
from services.forget.topics import sessions_of_user
from tests.kafka_wait import wait_for_events
from tests.services.proxy.conftest import StubProxy, wait_for_turns

pytestmark = pytest.mark.integration

ALICE = "alice-key-0123456789abcdef"
BOB = "bob-key-0123456789abcdef"


@pytest.fixture
def keyed_proxy(kafka: KafkaConfig, redis_config: RedisConfig, tmp_path: Path) -> Any:
    keys = tmp_path / "keys"
    keys.write_text(f"alice {ALICE}\nbob {BOB}\n")
    keys.chmod(0o600)
    proxy = StubProxy(kafka, redis_config, tmp_path, TURNSTREAM_PROXY_KEYS_FILE=str(keys))
    proxy.auth = {"Authorization": f"Bearer {ALICE}"}  # for its /metrics
    yield proxy
    proxy.close()


def ask(proxy: StubProxy, key: str, messages: list[dict[str, str]], **headers: str) -> httpx.Response:
    r = httpx.post(
        proxy.url + "/v1/chat/completions",
        json={"messages": messages, "max_tokens": 3},
        headers={"Authorization": f"Bearer {key}", **{k.replace("_", "-"): v for k, v in headers.items()}},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    return r


async def test_an_inferred_session_cannot_be_joined_ended_or_taken_by_another_user(
    keyed_proxy: StubProxy, kafka: KafkaConfig
) -> None:
    # Alice talks as a stock client does (no session id): the proxy names her session and tells her its id.
    history = [{"role": "user", "content": "plan my week"}]
    first = ask(keyed_proxy, ALICE, history)
    sid = first.headers["x-session-id"]
    assert sid.startswith("anon-")
    history += [first.json()["choices"][0]["message"], {"role": "user", "content": "and the weekend?"}]
    second = ask(keyed_proxy, ALICE, history)
    assert second.headers["x-session-id"] == sid  # continued by inference

    # Bob learnt the id: a main turn under it, a side turn ending it, and the namespaced form too.
    intruder = ask(keyed_proxy, BOB, [{"role": "user", "content": "poison"}], X_Session_Id=sid)
    assert intruder.headers["x-session-id"] == sid  # his own session of that name
    ask(keyed_proxy, BOB, [{"role": "user", "content": "x"}], X_Session_Id=f"alice/{sid}")
    ask(
        keyed_proxy,
        BOB,
        [{"role": "user", "content": "bye"}],
        X_Session_Id=sid,
        X_Turn_Type="side",
        X_Session_Done="true",
    )

    # Alice carries on, by inference and by naming the id herself: never refused, still her session.
    history += [second.json()["choices"][0]["message"], {"role": "user", "content": "thanks"}]
    third = ask(keyed_proxy, ALICE, history)
    assert third.headers["x-session-id"] == sid
    named = ask(keyed_proxy, ALICE, [{"role": "user", "content": "named"}], X_Session_Id=sid)
    assert named.headers["x-session-id"] == sid

    turns = await wait_for_turns(kafka, 6)
    recorded = sorted((t.session_id, t.turn_index, t.user) for t in turns)
    assert recorded == [
        (f"alice/{sid}", 1, "alice"),
        (f"alice/{sid}", 2, "alice"),
        (f"alice/{sid}", 3, "alice"),
        (f"alice/{sid}", 4, "alice"),
        (f"bob/alice/{sid}", 1, "bob"),
        (f"bob/{sid}", 1, "bob"),
    ]
    # Bob's end closed his session, not hers; erasing Bob would take none of hers.
    ended = await wait_for_events(kafka, SESSIONS_ENDED, lambda e: len(e) >= 1, timeout=20)
    assert [e.session_id for e in ended if isinstance(e, SessionEnded)] == [f"bob/{sid}"]
    assert await sessions_of_user(kafka, "bob", [kafka.namespace]) == {f"bob/{sid}", f"bob/alice/{sid}"}


async def test_an_explicit_id_cannot_be_squatted_nor_probed(
    keyed_proxy: StubProxy, kafka: KafkaConfig
) -> None:
    # Bob takes an id before Alice ever uses it: hers is still hers.
    squat = ask(keyed_proxy, BOB, [{"role": "user", "content": "mine now"}], X_Session_Id="team-standup")
    ask(keyed_proxy, ALICE, [{"role": "user", "content": "standup notes"}], X_Session_Id="team-standup")
    ask(keyed_proxy, ALICE, [{"role": "user", "content": "more notes"}], X_Session_Id="team-standup")
    # Probing: an id Alice uses and one nobody does get the same answer (status and headers).
    probes = [
        ask(keyed_proxy, BOB, [{"role": "user", "content": "?"}], X_Session_Id=name)
        for name in ("team-standup", "never-used-by-anyone")
    ]
    assert [p.status_code for p in probes] == [200, 200]
    assert (
        sorted(probes[0].headers.keys()) == sorted(probes[1].headers.keys()) == sorted(squat.headers.keys())
    )
    turns = await wait_for_turns(kafka, 5)
    recorded = sorted((t.session_id, t.turn_index) for t in turns)
    assert recorded == [
        ("alice/team-standup", 1),
        ("alice/team-standup", 2),
        ("bob/never-used-by-anyone", 1),
        ("bob/team-standup", 1),
        ("bob/team-standup", 2),
    ]


def test_a_keys_file_user_id_that_could_cross_namespaces_is_refused(tmp_path: Path) -> None:
    from services.proxy.keys import KeyFileError, read_keys_file

    for user in ("ali/ce", "x" * 65):
        keys = tmp_path / "keys"
        keys.write_text(f"{user} key-0123456789abcdef\n")
        with pytest.raises(KeyFileError, match="user id"):
            read_keys_file(keys)

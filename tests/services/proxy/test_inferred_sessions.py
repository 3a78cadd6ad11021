"""Clients that send no session id, through the real proxy to the real SGLang, Kafka and Redis: each
conversation becomes one session whose turns are numbered and paired, interleaved conversations and callers stay
apart, a regenerated or edited message branches (closing the superseded turn as ``regenerated``), and OpenClaw's
request shape (timestamped content parts, its internal-context block, streamed with usage) is followed."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from runtime.configuration.config import Config, KafkaConfig, RedisConfig
from schemas import SessionEnded
from schemas.topics import SESSIONS_ENDED
from tests.kafka_wait import wait_for_events
from tests.metrics import scraped
from tests.services.proxy.conftest import ProxyProcess, pair_all, wait_for_turns

pytestmark = pytest.mark.integration


def sdk(proxy: ProxyProcess, **kw: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=proxy.url + "/v1", api_key=kw.pop("api_key", "unused"), max_retries=0, **kw)


def say(
    client: openai.OpenAI, messages: list[dict[str, Any]], stream: bool = False, **kw: Any
) -> tuple[str, dict[str, Any]]:
    """One request as a stock client makes it (no session header); (the session id the proxy returned, the
    assistant message as the client keeps it in its history)."""
    raw = client.chat.completions.with_raw_response.create(
        model="turnstream-policy",
        messages=messages,
        max_tokens=6,
        temperature=0,
        stream=stream,
        **kw,  # type: ignore[arg-type]
    )
    sid = raw.headers["x-session-id"]
    if not stream:
        return sid, {"role": "assistant", "content": raw.parse().choices[0].message.content or ""}
    text = "".join(
        chunk.choices[0].delta.content or ""
        for chunk in raw.parse()
        if chunk.choices  # the usage chunk has none
    )
    return sid, {"role": "assistant", "content": text}


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def config(proxy_env: dict[str, str], kafka: KafkaConfig) -> Config:
    return Config(
        kafka=kafka,
        redis=RedisConfig(
            url=proxy_env["TURNSTREAM_REDIS_URL"], key_prefix=proxy_env["TURNSTREAM_REDIS_KEY_PREFIX"]
        ),
    )


async def test_interleaved_conversations_without_headers_are_one_session_each(
    proxy: ProxyProcess, proxy_env: dict[str, str], kafka: KafkaConfig
) -> None:
    client = sdk(proxy)
    histories: dict[str, list[dict[str, Any]]] = {"a": [], "b": []}
    sids: dict[str, set[str]] = {"a": set(), "b": set()}
    asks = {
        "a": ["Name a colour.", "Another one?", "Thanks."],
        "b": ["Name a fruit.", "No, a red one.", "Thanks."],
    }
    for i in range(3):
        for name, stream in (("a", False), ("b", True)):  # one conversation streamed, one not, interleaved
            history = histories[name]
            history.append(user(asks[name][i]))
            sid, answer = say(client, history, stream=stream)
            sids[name].add(sid)
            history.append(answer)
    assert all(len(s) == 1 for s in sids.values()), sids
    (sid_a,), (sid_b,) = sids["a"], sids["b"]
    assert sid_a != sid_b and sid_a.startswith("anon-")
    turns = await wait_for_turns(kafka, 6)
    assert sorted(t.turn_id for t in turns) == sorted(f"{s}:{n}" for s in (sid_a, sid_b) for n in (1, 2, 3))
    pairs = {p.turn_id: p for p in await pair_all(config(proxy_env, kafka), expect=4)}
    assert [m.content for m in pairs[f"{sid_b}:1"].next_state or []] == ["No, a red one."]
    assert [m.content for m in pairs[f"{sid_a}:2"].next_state or []] == ["Thanks."]
    assert not any(p.misaligned for p in pairs.values())
    assert scraped(proxy.url, "turnstream_proxy_sessions_total", how="continue") == 4
    assert scraped(proxy.url, "turnstream_proxy_sessions_total", how="new") == 2


async def test_a_regenerate_or_edit_branches_and_closes_the_superseded_turn(
    proxy: ProxyProcess, kafka: KafkaConfig
) -> None:
    client = sdk(proxy)
    history = [user("Say hello.")]
    sid, answer = say(client, history)
    history += [answer, user("Say goodbye.")]
    assert say(client, history)[0] == sid  # turn 2
    # The client regenerates the answer to turn 2: the same request again.
    regenerated, _ = say(client, history)
    assert regenerated != sid
    # An edit of the first message: a branch from the start; turn 2 is no longer the newest of any session it
    # could supersede (the regenerate already closed it), and the edit continues nothing.
    edited, _ = say(client, [user("Say hi.")])
    assert edited not in (sid, regenerated)
    turns = await wait_for_turns(kafka, 4)
    assert sorted(t.turn_id for t in turns) == sorted(
        [f"{sid}:1", f"{sid}:2", f"{regenerated}:1", f"{edited}:1"]
    )
    ends = await wait_for_events(kafka, SESSIONS_ENDED, lambda e: len(e) >= 1)
    assert [(e.session_id, e.after_turn_index, e.reason) for e in ends if isinstance(e, SessionEnded)] == [
        (sid, 2, "regenerated")
    ]
    assert scraped(proxy.url, "turnstream_proxy_regenerated_total") == 1


async def test_callers_and_users_never_share_a_session(proxy: ProxyProcess, kafka: KafkaConfig) -> None:
    """Two people typing the same first message get the same answer (temperature 0), but their second
    requests continue their own sessions: the ``user`` field scopes the match."""
    client = sdk(proxy)
    first: dict[str, tuple[str, dict[str, Any]]] = {
        who: say(client, [user("Hello!")], user=who) for who in ("u1", "u2")
    }
    assert first["u1"][1] == first["u2"][1] and first["u1"][0] != first["u2"][0]
    for who in ("u1", "u2"):
        sid, _ = say(client, [user("Hello!"), first[who][1], user("Bye.")], user=who)
        assert sid == first[who][0]
    # A caller with no ``user`` continuing the same text continues neither of them.
    other, _ = say(client, [user("Hello!"), first["u1"][1], user("Bye.")])
    assert other not in (first["u1"][0], first["u2"][0])


async def test_explicit_and_client_session_ids_win(proxy: ProxyProcess, kafka: KafkaConfig) -> None:
    client = sdk(proxy)
    sid, answer = say(client, [user("One.")], extra_headers={"x-session-affinity": "oc-affinity-1"})
    assert sid == "oc-affinity-1"
    again, _ = say(client, [user("One."), answer, user("Two.")], extra_headers={"X-Session-Id": "mine"})
    assert again == "mine"
    turns = await wait_for_turns(kafka, 2)
    assert sorted(t.turn_id for t in turns) == ["mine:1", "oc-affinity-1:1"]


async def test_session_inference_off_starts_a_session_per_turn(
    proxy_env: dict[str, str], kafka: KafkaConfig
) -> None:
    off = ProxyProcess({**proxy_env, "TURNSTREAM_PROXY_SESSION_INFERENCE": "off"})
    try:
        client = sdk(off)
        sid, answer = say(client, [user("One.")])
        assert say(client, [user("One."), answer, user("Two.")])[0] != sid
    finally:
        off.stop()


async def test_openclaws_request_shape_is_followed(
    proxy: ProxyProcess, proxy_env: dict[str, str], kafka: KafkaConfig
) -> None:
    """What stock OpenClaw sends (tests/services/proxy/fixtures/openclaw): a long system prompt, user messages
    as timestamped text parts, an internal-context message appended to each request only, streamed with usage;
    the assistant's answer sent back as a string."""
    client = sdk(proxy)
    system = {"role": "system", "content": "You are a personal assistant running inside OpenClaw.\n" * 40}
    context = {
        "role": "user",
        "content": "<<<BEGIN_OPENCLAW_INTERNAL_CONTEXT>>>\nchannel: cli\n<<<END_OPENCLAW_INTERNAL_CONTEXT>>>",
    }

    def stamped(text: str) -> dict[str, Any]:
        return {"role": "user", "content": [{"type": "text", "text": f"[Wed 2026-12-02 08:44 UTC] {text}"}]}

    history: list[dict[str, Any]] = [system]
    sids = set()
    for text in ("What is 2+2?", "No, answer in one word.", "Thanks."):
        history.append(stamped(text))
        sid, answer = say(client, [*history, context], stream=True, stream_options={"include_usage": True})
        sids.add(sid)
        history.append(answer)
    (sid,) = sids
    await wait_for_turns(kafka, 3)
    pairs = {p.turn_id: p for p in await pair_all(config(proxy_env, kafka), expect=2)}
    state = pairs[f"{sid}:1"].next_state or []
    assert [m.text for m in state] == ["[Wed 2026-12-02 08:44 UTC] No, answer in one word."]
    assert not pairs[f"{sid}:1"].misaligned and not pairs[f"{sid}:2"].misaligned


async def test_a_side_model_name_marks_housekeeping_calls(
    proxy_env: dict[str, str], kafka: KafkaConfig
) -> None:
    """A client that cannot send ``X-Turn-Type`` gives its housekeeping calls a model name of
    ``proxy.side_models``: served, never recorded, and they do not take the conversation's place."""
    side = ProxyProcess({**proxy_env, "TURNSTREAM_PROXY_SIDE_MODELS": "housekeeping,titles"})
    try:
        client = sdk(side)
        sid, answer = say(client, [user("One.")])
        history = [user("One."), answer]
        raw = client.chat.completions.with_raw_response.create(
            model="titles", messages=[*history, user("Title this chat.")], max_tokens=4
        )
        assert raw.parse().choices[0].message.content is not None and "x-session-id" not in raw.headers
        assert say(client, [*history, user("Two.")])[0] == sid
    finally:
        side.stop()
    turns = await wait_for_turns(kafka, 2)
    assert sorted(t.turn_id for t in turns) == [f"{sid}:1", f"{sid}:2"]

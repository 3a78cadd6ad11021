"""Conversation continuity: the canonical form tolerates what clients change when they send history back and
nothing else, scopes keep callers apart, and the Redis side (against the real server) continues, branches,
supersedes and gives back exactly as ``services/proxy/continuity.py`` says."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis

from runtime.configuration.config import RedisConfig
from runtime.transport.resp import PipelinedRedis, command
from services.proxy.continuity import Continuity, answered, canonical, links

SYSTEM = {"role": "system", "content": "You are helpful."}
CALL = {
    "id": "call_abc",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "units": "c"}'},
}


def body(*messages: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"messages": list(messages), **extra}


def next_link(
    request: dict[str, Any], answer: dict[str, Any], headers: dict[str, str] | None = None
) -> bytes:
    return answered(links(headers or {}, request).state, answer)


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def test_a_request_continues_the_link_its_predecessors_answer_made() -> None:
    first = body(SYSTEM, user("What is 2+2?"))
    answer = {"role": "assistant", "content": "4", "reasoning_content": "two and two", "tool_calls": None}
    assert links({}, first).continues is None  # nothing before it to continue
    second = body(SYSTEM, user("What is 2+2?"), {"role": "assistant", "content": "4"}, user("And 3+3?"))
    assert links({}, second).continues == next_link(first, answer)
    # The third continues the second's answer, not the first's.
    third = body(*second["messages"], {"role": "assistant", "content": "6"}, user("Thanks."))
    assert links({}, third).continues == next_link(second, {"role": "assistant", "content": "6"})
    assert links({}, third).continues != links({}, second).continues


@pytest.mark.parametrize(
    ("sent_back", "same"),
    [
        ({"role": "assistant", "content": "  4\n"}, True),  # whitespace at the ends
        ({"role": "assistant", "content": [{"type": "text", "text": "4"}]}, True),  # parts, not a string
        (
            {"role": "assistant", "content": [{"type": "text", "text": "4 "}, {"type": "text", "text": ""}]},
            True,
        ),
        ({"role": "assistant", "content": "4", "reasoning_content": "other thoughts"}, True),
        ({"role": "assistant", "content": "5"}, False),  # a different answer is a different conversation
        ({"role": "assistant", "content": "4."}, False),
        ({"role": "user", "content": "4"}, False),
    ],
)
def test_what_clients_change_in_history_is_tolerated_and_nothing_else(
    sent_back: dict[str, Any], same: bool
) -> None:
    first = body(user("What is 2+2?"))
    second = body(user("What is 2+2?"), sent_back, user("ok"))
    assert (links({}, second).continues == next_link(first, {"role": "assistant", "content": "4"})) is same


def test_tool_call_ids_and_argument_formatting_are_tolerated_but_not_other_arguments() -> None:
    first = body(user("Weather in Paris?"))
    answer = {"role": "assistant", "content": None, "tool_calls": [CALL]}
    link = next_link(first, answer)
    respaced = {
        **CALL,
        "id": "call_other",
        "function": {"name": "get_weather", "arguments": '{"units":"c","city":"Paris"}'},
    }
    result = {"role": "tool", "tool_call_id": "call_other", "content": "18 C"}
    assert (
        links(
            {},
            body(
                user("Weather in Paris?"),
                {"role": "assistant", "content": "", "tool_calls": [respaced]},
                result,
            ),
        ).continues
        == link
    )
    london = {**CALL, "function": {"name": "get_weather", "arguments": '{"city": "London", "units": "c"}'}}
    assert (
        links(
            {}, body(user("Weather in Paris?"), {"role": "assistant", "tool_calls": [london]}, result)
        ).continues
        != link
    )


def test_request_only_messages_neither_break_the_link_nor_count() -> None:
    context = {
        "role": "user",
        "content": "<<<BEGIN_OPENCLAW_INTERNAL_CONTEXT>>>\nruntime facts\n<<<END_OPENCLAW_INTERNAL_CONTEXT>>>",
    }
    first = body(SYSTEM, user("hi"), context)
    second = body(SYSTEM, user("hi"), {"role": "assistant", "content": "hello"}, user("bye"), context)
    assert links({}, second).continues == next_link(first, {"role": "assistant", "content": "hello"})
    # A request that adds nothing after the last answer but a request-only block continues nothing.
    assert (
        links({}, body(SYSTEM, user("hi"), {"role": "assistant", "content": "hello"}, context)).continues
        is None
    )


def test_scopes_keep_callers_apart() -> None:
    first = body(user("hello"))
    second = body(user("hello"), {"role": "assistant", "content": "hi"}, user("how are you"))
    answer = {"role": "assistant", "content": "hi"}
    alice = {"authorization": "Bearer sk-alice"}
    assert links(alice, second).continues == next_link(first, answer, alice)
    assert links({"authorization": "Bearer sk-bob"}, second).continues != next_link(first, answer, alice)
    assert links({}, second).continues != next_link(first, answer, alice)
    assert links({}, {**second, "user": "u1"}).continues == next_link({**first, "user": "u1"}, answer)
    assert links({}, {**second, "user": "u2"}).continues != next_link({**first, "user": "u1"}, answer)


def test_canonical_messages_are_unambiguous() -> None:
    # Role and text are separate fields: moving characters between them changes the bytes.
    assert canonical({"role": "user", "content": "ab"}) != canonical({"role": "use", "content": "rab"})
    assert canonical({"role": "assistant", "content": "x"}) != canonical(
        {"role": "assistant", "content": "x", "tool_calls": [CALL]}
    )


async def linked(replica: Continuity, digest: bytes, session_id: str, turn_index: int) -> None:
    """Store a link and wait until Redis has it: a reply is skipped, so a round trip on the same connection."""
    reply = replica.link(digest, session_id, turn_index)
    if reply is not None:
        await reply
    assert await replica.redis.send(command(b"INCRBY", b"test-barrier", b"0")) >= 0


@pytest.mark.integration
async def test_resolve_continues_branches_supersedes_and_gives_back(
    redis_config: RedisConfig, redis_client: aioredis.Redis
) -> None:
    replicas = [
        Continuity(PipelinedRedis(redis_config.url), redis_config.key_prefix, ttl_s=60) for _ in range(2)
    ]
    a, b = replicas
    await (
        redis_client.script_flush()
    )  # as after a Redis restart: EVALSHA answers NOSCRIPT, the script is sent
    try:
        first = await a.resolve(a.ask(None, "anon-1"))
        assert (first.how, first.session_id, first.turn_index, first.superseded) == ("new", "anon-1", 1, None)
        # Every session counter a resolution takes a number from expires (redis.session_ttl_s; issue 32 item 9).
        assert 0 < await redis_client.ttl(f"{redis_config.key_prefix}turns:anon-1") <= 30 * 86400

        await linked(a, b"link-1", "anon-1", 1)
        assert a.redis._conn is not None and a.redis._conn.can_skip  # later links are stored without a reply
        ttl = await redis_client.ttl(f"{redis_config.key_prefix}conv:{b'link-1'.hex()}")
        assert 0 < ttl <= 60
        # The other replica continues it (the state is in Redis), numbering on from the session's counter.
        second = await b.resolve(b.ask(b"link-1", "anon-unused"))
        assert (second.how, second.session_id, second.turn_index) == ("continue", "anon-1", 2)
        await linked(b, b"link-2", "anon-1", 2)
        # The same request again (a regenerate): a branch; turn 2 is the session's newest, so it is superseded.
        again = await a.resolve(a.ask(b"link-1", "anon-2"))
        assert (again.how, again.session_id, again.turn_index, again.superseded) == (
            "branch",
            "anon-2",
            1,
            ("anon-1", 2),
        )
        assert 0 < await redis_client.ttl(f"{redis_config.key_prefix}turns:anon-2") <= 30 * 86400
        # The first session went on meanwhile (turn 3 continues turn 2): a branch from turn 1 supersedes nothing
        # still open.
        third = await a.resolve(a.ask(b"link-2", "anon-unused"))
        assert (third.how, third.session_id, third.turn_index) == ("continue", "anon-1", 3)
        older = await b.resolve(b.ask(b"link-1", "anon-3"))
        assert (older.how, older.session_id, older.superseded) == ("branch", "anon-3", None)
        # An unanswered turn gives its link and number back: the retry continues, numbered the same.
        await linked(a, b"link-3", "anon-1", 3)
        failed = await a.resolve(a.ask(b"link-3", "anon-unused"))
        assert (failed.how, failed.turn_index) == ("continue", 4)
        await a.release(b"link-3", failed)
        retry = await b.resolve(b.ask(b"link-3", "anon-unused"))
        assert (retry.how, retry.session_id, retry.turn_index) == ("continue", "anon-1", 4)
        # Concurrent requests continuing one link: exactly one continues, the rest branch.
        await linked(a, b"link-4", "anon-1", 4)
        raced = await asyncio.gather(
            *(replicas[i % 2].resolve(replicas[i % 2].ask(b"link-4", f"anon-r{i}")) for i in range(6))
        )
        assert sorted(r.how for r in raced) == ["branch"] * 5 + ["continue"]
    finally:
        await asyncio.gather(*(r.redis.aclose() for r in replicas))


FIXTURES = Path(__file__).parent / "fixtures" / "openclaw"
EMPTY_ANSWERS = (1, 3)
"""The requests ``capture_server.py --mode empty`` answered with nothing."""


def captured(name: str) -> list[tuple[dict[str, str], dict[str, Any]]]:
    lines = (FIXTURES / f"{name}.jsonl").read_text().splitlines()
    return [(r["headers"], r["body"]) for r in map(json.loads, lines)]


def capture_reply(n: int, mode: str, request: dict[str, Any]) -> dict[str, Any]:
    """The answer ``scripts/openclaw/capture_server.py`` streamed to request ``n`` (1-based), as the proxy's
    ``Completion`` collects a stream: content, reasoning, tool calls with the arguments' text."""
    text = f"Answer number {n}."
    if mode == "tools":
        text = f"\n\n{text}  \n"
    elif mode == "think":
        text = f"<think>\nPondering request {n}.\n</think>\n\n{text}"
    elif mode == "empty" and n in EMPTY_ANSWERS:
        text = ""
    answer: dict[str, Any] = {"role": "assistant", "content": text, "tool_calls": None}
    if mode == "tools":
        answer["reasoning_content"] = f"Thinking about request {n}."
        offered = {t["function"]["name"] for t in request.get("tools") or ()}
        if not any(m["role"] == "tool" for m in request["messages"]) and "ls" in offered:
            answer["content"] = ""
            answer["tool_calls"] = [
                {
                    "id": f"call_req{n}_0",
                    "type": "function",
                    "function": {"name": "ls", "arguments": '{"path": "."}'},
                }
            ]
    return answer


def session_of(body: dict[str, Any]) -> str:
    """Which OpenClaw session a captured request belongs to (its first user message names it)."""
    first = next(m for m in body["messages"] if m["role"] == "user")
    return re.search(r"sessionId=(\w+)", first["content"]).group(1)  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("name", "mode"),
    [
        ("default", "text"),
        ("lean", "text"),
        ("lean-affinity", "text"),
        ("tools", "tools"),
        ("think", "think"),
    ],
)
def test_stock_openclaws_captured_requests_continue_their_own_session_only(name: str, mode: str) -> None:
    """Requests stock OpenClaw 2026.9.6 sent (fixtures/openclaw/README.md: reasoning dropped, think blocks
    stripped, tool-call ids rewritten, arguments re-serialised, an internal-context block on each request only):
    each continues the link its session's previous answer made, and no other session's."""
    requests = captured(name)
    made: dict[str, bytes] = {}  # the link each session's latest answer made
    for n, (headers, request) in enumerate(requests, start=1):
        sid = session_of(request)
        chain = links(headers, request)
        continues = chain.continues
        if sid in made:
            assert continues == made[sid], f"{name} request {n} does not continue {sid}"
            assert continues not in [link for other, link in made.items() if other != sid]
        else:
            assert continues is None
        made[sid] = answered(chain.state, capture_reply(n, mode, request))
    assert len(requests) - len(made) >= 2  # continuations were checked


def test_openclaws_retry_of_an_empty_answer_is_a_regenerate_and_the_conversation_goes_on() -> None:
    """What stock OpenClaw sent after empty answers (fixtures/openclaw/empty.jsonl): it asks again with the same
    history plus an instruction it sends once, then keeps only the retry's answer. The instruction is request-only:
    the retry continues what the empty attempt continued (a regenerate: ``resolve`` branches it and closes the
    empty turn when it was its session's newest), and the next request continues the retry's answer."""
    requests = captured("empty")
    assert len(requests) == 5
    chains = [links(headers, request) for headers, request in requests]
    made = [
        answered(c.state, capture_reply(n, "empty", r))
        for n, (c, (_, r)) in enumerate(zip(chains, requests, strict=True), 1)
    ]
    assert chains[0].continues is None and chains[1].continues is None  # the opening, then its retry
    assert chains[2].continues == made[1]  # "No, answer in one word." continues the retry's answer
    assert chains[3].continues == chains[2].continues  # its retry continues the same answer: a branch
    assert chains[4].continues == made[3]  # "Thanks." continues the second retry's answer
    assert made[1] != made[0] and made[3] != made[2]


AIDER = json.loads((Path(__file__).parent / "fixtures" / "aider" / "requests.json").read_text())
"""What aider 0.86.2 adds around a conversation, built by its own prompt classes (``aider/coders/*_prompts.py``
formatted as ``Coder.fmt_system_prompt`` does): each edit format's reminder, and the files-in-chat pair (with a
file, and without any)."""


def aider(done: list[dict[str, Any]], current: str, edit_format: str, mode: str, pair: str) -> dict[str, Any]:
    """A request laid out as aider's ``Coder.format_chat_chunks`` does: system prompt, the conversation so far, the
    files-in-chat pair, the current message with the edit format's reminder appended after a blank line
    (``reminder: user``, the default) or sent as a last system message (``reminder: sys``)."""
    reminder = AIDER["reminders"][edit_format]
    files, reply = AIDER[pair]
    system = {"role": "system", "content": "Act as an expert software developer.\n" + reminder}
    messages = [system, *done, user(files), {"role": "assistant", "content": reply}]
    if mode == "user":
        return body(*messages, user(current + "\n\n" + reminder))
    return body(*messages, user(current), {"role": "system", "content": reminder})


@pytest.mark.parametrize("pair", ["files_pair", "no_files_pair"])
@pytest.mark.parametrize("mode", ["user", "sys"])
@pytest.mark.parametrize("edit_format", sorted(AIDER["reminders"]))
def test_aiders_reminder_and_files_pair_neither_break_the_link_nor_count(
    edit_format: str, mode: str, pair: str
) -> None:
    asked, fixed = user("Add a docstring to hello.py."), user("No, a comment.")
    answer, again = {"role": "assistant", "content": "Done."}, {"role": "assistant", "content": "Fixed."}
    first = aider([], asked["content"], edit_format, mode, pair)
    second = aider([asked, answer], fixed["content"], edit_format, mode, pair)
    third = aider([asked, answer, fixed, again], "Thanks.", edit_format, mode, pair)
    assert links({}, first).continues is None
    assert links({}, second).continues == next_link(first, answer)
    assert links({}, third).continues == next_link(second, again)
    # What the user wrote still tells conversations apart.
    other = aider([user("Add a test."), answer], fixed["content"], edit_format, mode, pair)
    assert links({}, other).continues != next_link(first, answer)

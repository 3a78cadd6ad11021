"""The pairer: next states with roles, misaligned histories, session done, idle timeouts, and replay."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest

from runtime.configuration.config import Config, KafkaConfig, PairerConfig, RedisConfig
from runtime.messaging.bus import EventProducer, read_topic
from runtime.messaging.topics import create_topics
from schemas import FunctionCall, Message, PairedTurn, SessionEnded, ToolCall, Turn
from schemas.topics import SESSIONS_ENDED, TURNS, TURNS_PAIRED
from services.pairer.worker import next_state
from tests.services.proxy.conftest import pair_all
from tests.strategies import example_turn

FIXTURES = Path(__file__).resolve().parents[1] / "proxy" / "fixtures"
U = Message(role="user", content="What's the weather in Paris and Oslo?")
CALLS = Message(
    role="assistant",
    content="",
    tool_calls=[
        ToolCall(id="c1", function=FunctionCall(name="weather", arguments='{"city": "Paris"}')),
        ToolCall(id="c2", function=FunctionCall(name="weather", arguments='{"city": "Oslo"}')),
    ],
)
T1 = Message(role="tool", content="18C", tool_call_id="c1")
T2 = Message(role="tool", content="9C", tool_call_id="c2")


def turn(sid: str, n: int, messages: list[Message], response: Message, t: float = 1000.0, **kw: Any) -> Turn:
    return example_turn(sid, n, messages=messages, response=response, created_at=t, completed_at=t + 1, **kw)


def test_next_state_keeps_every_tool_result_with_roles() -> None:
    first = turn("s", 1, [U], CALLS)
    second = turn("s", 2, [U, CALLS, T1, T2], Message(role="assistant", content="Paris 18C, Oslo 9C."))
    state, misaligned = next_state(first, second)
    assert state == [T1, T2] and not misaligned


def test_reasoning_dropped_by_the_client_still_aligns() -> None:
    resp = Message(role="assistant", content="Hello!", reasoning_content="greet back")
    first = turn("s", 1, [U], resp)
    thanks = Message(role="user", content="thanks")
    second = turn("s", 2, [U, Message(role="assistant", content="Hello!"), thanks], resp)
    assert next_state(first, second) == ([thanks], False)


def test_tool_arguments_re_serialised_by_the_client_still_align() -> None:
    """A client that parses the recorded call and serialises it again (no spaces, other key order) sent it back
    unchanged; a call with other arguments is another call."""
    first = turn("s", 1, [U], CALLS)

    def history(paris: str) -> Message:
        c1 = ToolCall(id="c1", function=FunctionCall(name="weather", arguments=paris))
        return msgspec.structs.replace(CALLS, tool_calls=[c1, CALLS.tool_calls[1]])  # type: ignore[index]

    again = turn("s", 2, [U, history('{"city":"Paris"}'), T1, T2], Message(role="assistant", content="ok"))
    assert next_state(first, again) == ([T1, T2], False)
    other = turn("s", 2, [U, history('{"city": "Lyon"}'), T1, T2], Message(role="assistant", content="ok"))
    assert next_state(first, other) == ([T2], True)


def test_a_history_without_the_response_is_flagged_and_uses_the_last_message() -> None:
    first = turn("s", 1, [U], Message(role="assistant", content="It is sunny."))
    edited = Message(role="assistant", content="Something else entirely.")
    last = Message(role="user", content="no, redo it")
    second = turn("s", 2, [U, edited, last], Message(role="assistant", content="ok"))
    assert next_state(first, second) == ([last], True)


OPENCLAW_CONTEXT = Message(
    role="user",
    content="<<<BEGIN_OPENCLAW_INTERNAL_CONTEXT>>>\nruntime: model turnstream\n<<<END_OPENCLAW_INTERNAL_CONTEXT>>>",
)


def test_a_request_only_block_is_neither_history_nor_next_state() -> None:
    """Stock OpenClaw appends an internal-context message to each request and leaves it out of later history:
    the next state is what the user said, not the block (it used to be flagged misaligned and paired with it)."""
    system = Message(role="system", content="You are a personal assistant.")
    asked = Message(
        role="user", content=[{"type": "text", "text": "[Wed 2026-12-02 08:44 UTC] What is 2+2?"}]
    )
    answer = Message(role="assistant", content="4")
    first = turn("oc", 1, [system, asked, OPENCLAW_CONTEXT], answer)
    correction = Message(
        role="user", content=[{"type": "text", "text": "[Wed 2026-12-02 08:52 UTC] No, answer in one word."}]
    )
    second = turn(
        "oc",
        2,
        [system, asked, answer, correction, OPENCLAW_CONTEXT],
        Message(role="assistant", content="Four"),
    )
    assert next_state(first, second) == ([correction], False)


def test_a_client_that_trims_old_history_still_aligns() -> None:
    resp = Message(role="assistant", content="Hello!")
    first = turn("s", 1, [Message(role="system", content="sys"), U], resp)
    thanks = Message(role="user", content="thanks")
    second = turn("s", 2, [U, resp, thanks], resp)  # the system message dropped
    assert next_state(first, second) == ([thanks], False)


@pytest.fixture
def pairer_config(kafka: KafkaConfig, redis_config: RedisConfig) -> Config:
    return Config(
        kafka=kafka,
        redis=redis_config,
        pairer=PairerConfig(idle_timeout_s=2.0, sweep_interval_s=0.2, group_id="pairer-test"),
    )


def summary(p: PairedTurn) -> tuple[Any, ...]:
    state = None if p.next_state is None else msgspec.to_builtins(p.next_state)
    return (p.turn_id, p.terminal_reason, p.misaligned, msgspec.json.encode(state))


async def test_pairing_live_and_replayed(pairer_config: Config, kafka: KafkaConfig) -> None:
    now = time.time()
    done_turn = turn("done", 1, [U], Message(role="assistant", content="bye"), now, session_done=True)
    turns = [
        turn("tools", 1, [U], CALLS, now),
        turn("tools", 2, [U, CALLS, T1, T2], Message(role="assistant", content="18C and 9C"), now + 2),
        turn("redo", 1, [U], Message(role="assistant", content="sunny"), now),
        turn(
            "redo",
            2,
            [U, Message(role="assistant", content="edited"), Message(role="user", content="redo")],
            Message(role="assistant", content="ok"),
            now + 2,
        ),
        done_turn,
        turn("gap", 1, [U], Message(role="assistant", content="a"), now - 100),
        turn(
            "gap",
            2,
            [U, Message(role="assistant", content="a"), Message(role="user", content="b")],
            Message(role="assistant", content="c"),
            now,
        ),  # arrives 99 s after turn 1: past the idle timeout
        turn("quiet", 1, [U], Message(role="assistant", content="x"), now),  # nothing follows
        turn("side", 1, [U], Message(role="assistant", content="one"), now),
        turn(
            "side",
            2,
            [U, Message(role="assistant", content="one"), Message(role="user", content="two?")],
            Message(role="assistant", content="two"),
            now + 1,
        ),  # then the client ends the session on a side request (X-Session-Done)
    ]
    async with EventProducer(kafka) as producer:
        for t in turns:
            await producer.send(TURNS, t, t.session_id)
        await producer.send(TURNS, turns[0], "tools")  # a redelivered duplicate is not paired twice
        await producer.send(
            SESSIONS_ENDED, SessionEnded(session_id="side", after_turn_index=2, ended_at=now + 2), "side"
        )

    live = await pair_all(pairer_config, expect=10)
    by = {(p.turn_id, p.terminal_reason): p for p in live}
    assert by[("tools:1", None)].next_state == [T1, T2] and not by[("tools:1", None)].misaligned
    assert by[("redo:1", None)].misaligned and by[("redo:1", None)].next_state[0].content == "redo"
    assert by[("done:1", "session_done")].next_state is None
    assert ("gap:1", "idle_timeout") in by and ("gap:1", None) not in by
    # Sessions left open end by the wall-clock sweep once idle: quiet:1, tools:2, redo:2, gap:2.
    for tid in ("quiet:1", "tools:2", "redo:2", "gap:2"):
        assert (tid, "idle_timeout") in by
    assert by[("side:1", None)].next_state[0].content == "two?"
    assert ("side:2", "session_done") in by and ("side:2", "idle_timeout") not in by
    assert len(live) == 10, [summary(p) for p in live]

    # Replay: the same turns into a fresh namespace and Redis prefix give the same pairs.
    replay_kafka = msgspec.structs.replace(kafka, namespace="replay-" + kafka.namespace)
    await create_topics(replay_kafka, partitions=3)
    async with EventProducer(replay_kafka) as producer:
        async for rec in read_topic(kafka, TURNS):
            await producer.send(TURNS, rec.event, rec.key)
        async for ended in read_topic(kafka, SESSIONS_ENDED):
            await producer.send(SESSIONS_ENDED, ended.event, ended.key)
    replay_config = msgspec.structs.replace(
        pairer_config,
        kafka=replay_kafka,
        redis=msgspec.structs.replace(
            pairer_config.redis, key_prefix=pairer_config.redis.key_prefix + "replay:"
        ),
    )
    replayed = await pair_all(replay_config, expect=10)
    assert sorted(map(summary, replayed)) == sorted(map(summary, live))


async def test_a_backlog_of_old_turns_is_paired_before_any_idle_sweep(
    pairer_config: Config, kafka: KafkaConfig
) -> None:
    """Turns recorded a day ago, read as a backlog (a replay, a pairer back after downtime): by the clock every
    session looks idle, but the sweep must wait until the pairer has caught up, or it closes sessions whose next
    turn it simply has not read yet. Every first turn gets its next state; only the last turns end idle."""
    day_ago = time.time() - 86400
    sessions = [f"old{i}" for i in range(60)]
    first = [turn(s, 1, [U], Message(role="assistant", content="a"), day_ago) for s in sessions]
    follow = [Message(role="assistant", content="a"), Message(role="user", content="more")]
    second = [turn(s, 2, [U, *follow], Message(role="assistant", content="b"), day_ago + 1) for s in sessions]
    async with EventProducer(kafka) as producer:
        for t in first + second:  # all first turns before any second turn: a wide window for a wrong sweep
            await producer.send(TURNS, t, t.session_id)
    small_polls = msgspec.structs.replace(
        pairer_config, kafka=msgspec.structs.replace(kafka, max_batch=4)
    )  # many polls, each followed by a sweep check (every 0.2 s)
    paired = await pair_all(small_polls, expect=120)
    by = {(p.turn_id, p.terminal_reason): p for p in paired}
    assert len(paired) == 120, [summary(p) for p in paired if p.terminal_reason]
    for s in sessions:
        assert by[(f"{s}:1", None)].next_state == [follow[1]]
        assert (f"{s}:2", "idle_timeout") in by


async def test_a_session_end_closes_the_turn_it_names_whenever_it_arrives(
    pairer_config: Config, kafka: KafkaConfig
) -> None:
    """``sessions.ended`` is not ordered with ``turns``: an end that arrives before the turn it names waits for
    it; one that names a turn the session has gone past changes nothing; one without a number (the proxy could
    not read it) closes the open turn; one for a session without turns does nothing."""
    import redis.asyncio as aioredis

    from services.pairer.worker import ENDS, Pairer

    def counted(outcome: str) -> float:
        return ENDS.labels(outcome)._value.get()  # type: ignore[no-any-return]

    def reply(sid: str, n: int) -> Turn:
        history = [
            U,
            Message(role="assistant", content=f"{sid}{n - 1}"),
            Message(role="user", content="more"),
        ]
        return turn(sid, n, [U] if n == 1 else history, Message(role="assistant", content=f"{sid}{n}"))

    before = {o: counted(o) for o in ("waiting", "closed", "stale", "no_open_turn")}
    redis = aioredis.from_url(pairer_config.redis.url)
    try:
        async with EventProducer(kafka) as producer:
            pairer = Pairer(pairer_config, redis, producer)
            await pairer.on_turn(reply("early", 1))
            await pairer.on_session_ended(SessionEnded(session_id="early", after_turn_index=2, ended_at=1.0))
            await pairer.on_turn(reply("early", 2))
            await pairer.on_turn(reply("past", 1))
            await pairer.on_turn(reply("past", 2))
            await pairer.on_session_ended(SessionEnded(session_id="past", after_turn_index=1, ended_at=1.0))
            await pairer.on_turn(reply("unnumbered", 1))
            await pairer.on_session_ended(
                SessionEnded(session_id="unnumbered", after_turn_index=None, ended_at=1.0)
            )
            await pairer.on_session_ended(SessionEnded(session_id="empty", after_turn_index=0, ended_at=1.0))
        open_sessions = {
            k.decode().rpartition(":")[2]
            for k in await redis.keys(pairer_config.redis.key_prefix + "pairer:s:*")
        }
        waiting_ends = await redis.keys(pairer_config.redis.key_prefix + "pairer:ended:*")
    finally:
        await redis.aclose()
    got = {(p.turn_id, p.terminal_reason) for p in await read_all(kafka)}
    assert got == {
        ("early:1", None),
        ("early:2", "session_done"),
        ("past:1", None),
        ("unnumbered:1", "session_done"),
    }
    assert open_sessions == {"past"}, "only past:2 waits for its next state"
    assert waiting_ends == [], "the early end was used"
    assert {o: counted(o) - before[o] for o in before} == {
        "waiting": 1,
        "closed": 2,
        "stale": 1,
        "no_open_turn": 1,
    }


async def test_a_regenerated_turn_closes_as_such_and_unlearned_turns_are_counted(
    pairer_config: Config, kafka: KafkaConfig
) -> None:
    """The proxy's ``regenerated`` end closes the turn it names as ``regenerated``, whether it arrives before or
    after the turn; a lone turn that goes idle counts as ``no_session`` (what a client without sessions makes)."""
    import redis.asyncio as aioredis

    from services.pairer.worker import UNPAIRED, Pairer

    def counted(reason: str) -> float:
        return UNPAIRED.labels(reason)._value.get()  # type: ignore[no-any-return]

    before = {r: counted(r) for r in ("regenerated", "no_session", "idle_timeout")}
    answer = Message(role="assistant", content="a")
    follow = [U, answer, Message(role="user", content="more")]
    redis = aioredis.from_url(pairer_config.redis.url)
    try:
        async with EventProducer(kafka) as producer:
            pairer = Pairer(pairer_config, redis, producer)
            await pairer.on_turn(turn("after", 1, [U], answer))
            await pairer.on_turn(turn("after", 2, follow, answer))
            await pairer.on_session_ended(
                SessionEnded(session_id="after", after_turn_index=2, ended_at=1.0, reason="regenerated")
            )
            await pairer.on_turn(turn("before", 1, [U], answer))
            await pairer.on_session_ended(
                SessionEnded(session_id="before", after_turn_index=2, ended_at=1.0, reason="regenerated")
            )
            await pairer.on_turn(turn("before", 2, follow, answer))
            await pairer.on_turn(turn("lone", 1, [U], answer, t=time.time() - 100))
            await pairer.on_turn(turn("long", 1, [U], answer, t=time.time() - 100))
            await pairer.on_turn(turn("long", 2, follow, answer, t=time.time() - 99))
            assert await pairer.sweep(time.time()) == 2
    finally:
        await redis.aclose()
    got = {(p.turn_id, p.terminal_reason) for p in await read_all(kafka)}
    assert got == {
        ("after:1", None),
        ("after:2", "regenerated"),
        ("before:1", None),
        ("before:2", "regenerated"),
        ("lone:1", "idle_timeout"),
        ("long:1", None),
        ("long:2", "idle_timeout"),
    }
    assert {r: counted(r) - before[r] for r in before} == {
        "regenerated": 2,
        "no_session": 1,
        "idle_timeout": 1,
    }


async def read_all(kafka: KafkaConfig) -> list[PairedTurn]:
    return [rec.event async for rec in read_topic(kafka, TURNS_PAIRED)]


def test_stock_openclaws_captured_requests_pair_with_what_the_user_said() -> None:
    """Two requests stock OpenClaw sent for one session (tests/services/proxy/fixtures/openclaw/default.jsonl,
    answered "Answer number 1."): the next state is the user's correction, not the internal-context block that
    ends each request."""
    from pathlib import Path

    lines = (
        (Path(__file__).parents[2] / "services/proxy/fixtures/openclaw/default.jsonl")
        .read_text()
        .splitlines()
    )
    first, _, third = (msgspec.json.decode(line)["body"] for line in lines[:3])
    as_turn = lambda n, body, answer: turn(  # noqa: E731
        "S1", n, msgspec.convert(body["messages"], list[Message]), Message(role="assistant", content=answer)
    )
    state, misaligned = next_state(
        as_turn(1, first, "Answer number 1."), as_turn(2, third, "Answer number 3.")
    )
    assert not misaligned
    assert [(m.role, m.text) for m in state] == [
        ("user", "[Wed 2026-12-02 15:57 UTC] No, answer in one word.")
    ]


def _partition(session_id: str, partitions: int) -> int:
    """The partition Kafka's default partitioner (aiokafka's, murmur2 of the key) gives a session's turns."""
    from aiokafka.partitioner import DefaultPartitioner

    every = list(range(partitions))
    return int(DefaultPartitioner()(session_id.encode(), every, every))


async def test_a_record_too_large_to_pair_is_dead_lettered_and_its_partition_moves_on(
    kafka: KafkaConfig, redis_config: RedisConfig
) -> None:
    """Issue 32, item 1: two ~8.2 MiB turns in one session (the bulk in a ``name`` field, as an old proxy recorded
    them) make a pairing over Kafka's 16 MiB record limit. The pairer used to retry that batch forever, and the
    sessions behind it on the partition were never paired. Now the turn whose pairing cannot be produced ends on
    ``deadletter`` (its payload kept, the letter fitting) after a few attempts, and twelve later sessions on the
    same partition are paired within seconds."""
    from schemas import DeadLetter, decode
    from schemas.topics import DEADLETTER, MAX_MESSAGE_BYTES
    from tests.conftest import TEST_PARTITIONS
    from tests.kafka_wait import wait_for_events

    bulk = "x" * (8 * 1024 * 1024 + 200_000)
    big = "big-session"
    where = _partition(big, TEST_PARTITIONS)
    later = [s for s in (f"later-{i}" for i in range(400)) if _partition(s, TEST_PARTITIONS) == where][:12]
    assert len(later) == 12
    t = time.time()
    first = turn(
        big, 1, [Message(role="user", content="hi", name=bulk)], Message(role="assistant", content="a"), t
    )
    second = turn(
        big,
        2,
        [Message(role="user", content="hi"), first.response, Message(role="user", content="more", name=bulk)],
        Message(role="assistant", content="b"),
        t + 2,
    )
    async with EventProducer(kafka) as producer:
        for big_turn in (first, second):
            await producer.send(TURNS, big_turn, big)
        for i, sid in enumerate(later):
            user = Message(role="user", content=f"question {i}")
            answer = Message(role="assistant", content=f"answer {i}")
            await producer.send(TURNS, turn(sid, 1, [user], answer, t + 3), sid)
            follow = [user, answer, Message(role="user", content="thanks")]
            await producer.send(
                TURNS, turn(sid, 2, follow, Message(role="assistant", content="ok"), t + 4), sid
            )
    config = Config(
        kafka=kafka,
        redis=redis_config,
        pairer=PairerConfig(idle_timeout_s=3600, sweep_interval_s=60, group_id="pairer-wedge"),
    )
    started = time.monotonic()
    paired = await pair_all(config, expect=12, timeout=60)
    took = time.monotonic() - started
    assert sorted(p.turn_id for p in paired if p.turn.session_id in later) == sorted(f"{s}:1" for s in later)
    assert took < 30, f"the later sessions waited {took:.1f} s"
    letters = await wait_for_events(kafka, DEADLETTER, lambda found: len(found) >= 1, 30)
    [letter] = [d for d in letters if isinstance(d, DeadLetter)]
    assert (letter.source_topic, letter.source_partition) == (TURNS.name(kafka.namespace), where)
    assert letter.consumer_group == "pairer-wedge" and "RecordTooLarge" in letter.error
    assert decode(letter.payload, Turn).turn_id == f"{big}:2"
    assert len(letter.payload) < MAX_MESSAGE_BYTES
    assert not any(p.turn.session_id == big and p.next_state for p in paired)


async def test_every_key_the_pairer_writes_expires(
    pairer_config: Config, kafka: KafkaConfig, redis_client: Any
) -> None:
    """Issue 32 item 9: a session's open turn (the whole conversation so far) stayed in Redis until a sweep that
    may never come. Every key expires (``pairer.state_ttl_s``), save the set of open sessions, which the sweep
    empties; a state that expired unswept is counted, not silently passed over."""
    from services.pairer.worker import SKIPPED, Pairer

    await create_topics(kafka)
    config = msgspec.structs.replace(
        pairer_config, pairer=msgspec.structs.replace(pairer_config.pairer, state_ttl_s=600.0)
    )
    prefix = config.redis.key_prefix
    now = time.time()
    async with EventProducer(kafka) as producer:
        pairer = Pairer(config, redis_client, producer)
        await pairer.on_turn(turn("exp-a", 1, [U], Message(role="assistant", content="a"), now))
        await pairer.on_turn(turn("exp-b", 1, [U], Message(role="assistant", content="b"), now))
        await pairer.on_session_ended(SessionEnded(session_id="exp-c", after_turn_index=3, ended_at=now))
        keys = [k.decode() async for k in redis_client.scan_iter(match=f"{prefix}*")]
        assert f"{prefix}pairer:s:exp-a" in keys and f"{prefix}pairer:ended:exp-c" in keys
        for key in keys:
            if key == config.redis.pairer_idle_key:
                continue
            assert 0 < await redis_client.ttl(key) <= (600 if ":s:" in key else 7 * 86400), key
        # exp-b's state expires before any sweep: the sweep drops it from the open set and counts it.
        await redis_client.delete(f"{prefix}pairer:s:exp-b")
        expired = SKIPPED.labels("state_expired")._value.get()
        assert await pairer.sweep(now + 3) == 1  # exp-a closed idle; exp-b counted
        assert SKIPPED.labels("state_expired")._value.get() == expired + 1
        assert not await redis_client.exists(config.redis.pairer_idle_key)


def test_aiders_reminder_and_files_pair_are_neither_history_nor_next_state() -> None:
    """aider appends its edit format's rules to the current message (taken off when the message is history) and
    re-sends a files-in-chat pair before it in every request (fixtures of aider 0.86.2's prompts): the next state
    is what the user wrote."""
    aider = json.loads((FIXTURES / "aider" / "requests.json").read_text())
    reminder = aider["reminders"]["wholefile"]
    files = [Message(role="user", content=aider["files_pair"][0]), Message(role="assistant", content="Ok.")]
    system = Message(role="system", content="Act as an expert software developer.")
    asked, answer = (
        Message(role="user", content="Add a docstring."),
        Message(role="assistant", content="Done."),
    )
    first = turn(
        "ai", 1, [system, *files, Message(role="user", content=f"{asked.text}\n\n{reminder}")], answer
    )
    correction = Message(role="user", content="No, a comment.")
    second = turn(
        "ai",
        2,
        [system, asked, answer, *files, Message(role="user", content=f"{correction.text}\n\n{reminder}")],
        Message(role="assistant", content="Fixed."),
    )
    assert next_state(first, second) == ([correction], False)

"""turnstream replay on the real Kafka broker and Redis: export/import round trips (both formats), re-deriving
recorded turns into a new namespace with another judge id, and re-driving sessions through a real proxy and the
CPU engine. Each command runs as a user would run it: ``python -m services.cli replay ...``."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import msgspec
import pytest

from runtime.configuration.config import KafkaConfig, RedisConfig
from runtime.engine.chat_template import render_prompt_ids
from runtime.messaging.bus import EventProducer, read_topic
from runtime.messaging.topics import create_topics
from schemas import FunctionCall, Message, PairedTurn, ToolCall, Turn
from schemas.topics import JUDGMENTS, SAMPLES, TURNS, TURNS_PAIRED
from services.engine.launch import EngineProcess
from tests.kafka_wait import wait_for_events
from tests.services.proxy.conftest import ProxyProcess
from tests.strategies import example_turn

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[3]
U1 = Message(role="user", content="Where is the Eiffel tower?")
A1 = Message(role="assistant", content="In Paris.")


def cli(*args: str, kafka: KafkaConfig, redis: RedisConfig, timeout: float = 600, **env: str) -> Any:
    full_env = {
        **os.environ,
        **kafka.client_env(),
        "TURNSTREAM_REDIS_URL": redis.url,
        "TURNSTREAM_REDIS_KEY_PREFIX": redis.key_prefix,
        "OMP_NUM_THREADS": "1",
        **env,
    }
    return subprocess.run(
        [sys.executable, "-m", "services.cli", "replay", *args],
        cwd=REPO,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def session(sid: str, follow_up: str, *, done: bool) -> list[Turn]:
    """Two turns: the second request holds the first turn's response and the user's follow-up."""
    t1 = example_turn(sid, 1, messages=[U1], response=A1)
    t2 = example_turn(
        sid,
        2,
        messages=[U1, A1, Message(role="user", content=follow_up)],
        response=Message(role="assistant", content="Sure."),
        session_done=done,
    )
    return [t1, t2]


async def publish(kafka: KafkaConfig, turns: list[Turn]) -> None:
    async with EventProducer(kafka) as producer:
        for t in turns:
            await producer.send(TURNS, t, t.session_id)


async def turns_of(kafka: KafkaConfig) -> list[Turn]:
    return [r.event async for r in read_topic(kafka, TURNS)]


def other_namespace(kafka: KafkaConfig, label: str) -> KafkaConfig:
    return msgspec.structs.replace(kafka, namespace=f"{label}-{uuid.uuid4().hex[:8]}.")


async def test_export_and_import_round_trip_exactly(
    kafka: KafkaConfig, redis_config: RedisConfig, tmp_path: Path
) -> None:
    recorded = session("a", "Thanks!", done=True) + session("b", "More please", done=False)
    await publish(kafka, recorded)
    out = tmp_path / "sessions.jsonl"
    r = cli("export", "--out", str(out), kafka=kafka, redis=redis_config)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["turns"] == 4
    assert stat.S_IMODE(out.stat().st_mode) == 0o600  # people's conversations: the owner's only
    lines = out.read_bytes().splitlines()
    assert [json.loads(x)["turn_id"] for x in lines] == ["a:1", "a:2", "b:1", "b:2"]

    target = other_namespace(kafka, "imported")
    r = cli("import", "--input", str(out), "--into", target.namespace, kafka=kafka, redis=redis_config)
    assert r.returncode == 0, r.stderr
    imported = sorted(await turns_of(target), key=lambda t: t.turn_id)
    assert imported == sorted(
        recorded, key=lambda t: t.turn_id
    )  # every field, token ids and log-probs included

    # A bad line refuses the whole import and says where; --skip-bad imports the rest and lists it. Bad too
    # (issue 42): a line nested 5,000 deep (it ended the import in a RecursionError), a session id the proxy
    # refuses, a turn_id that does not name its session and turn.
    deep = b'{"turn_id": "x:1", "session_id": "x", "messages": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    first = json.loads(lines[0])
    foreign = json.dumps({**first, "session_id": "caf\u00e9", "turn_id": "caf\u00e9:1"}).encode()
    mismatched = json.dumps({**first, "turn_id": "someone-else:1"}).encode()
    broken = tmp_path / "broken.jsonl"
    bad = [b'{"turn_id": "x:1", "session_id": "x"}', deep, foreign, mismatched]
    broken.write_bytes(b"\n".join([lines[0], *bad, lines[1]]) + b"\n")
    second = other_namespace(kafka, "imported2")
    r = cli("import", "--input", str(broken), "--into", second.namespace, kafka=kafka, redis=redis_config)
    assert r.returncode == 2 and "line 2" in r.stderr and "Traceback" not in r.stderr
    r = cli(
        "import",
        "--input",
        str(broken),
        "--into",
        second.namespace,
        "--skip-bad",
        kafka=kafka,
        redis=redis_config,
    )
    assert r.returncode == 0, r.stderr
    listed = json.loads(r.stdout)["bad_lines"]
    assert [x.split(":")[0] for x in listed] == ["line 2", "line 3", "line 4", "line 5"], listed
    assert "nested too deeply" in listed[1] and "printable ASCII" in listed[2] and "turn_id" in listed[3]
    assert sorted(t.turn_id for t in await turns_of(second)) == ["a:1", "a:2"]


async def test_openclaw_export_and_import_through_the_policy_engine(
    kafka: KafkaConfig, redis_config: RedisConfig, tmp_path: Path, engine: EngineProcess, smollm2_path: Path
) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_path)
    messages = [{"role": "user", "content": "Where is the Eiffel tower?"}]
    prompt = render_prompt_ids(tok, messages)
    t1 = example_turn("oc", 1, messages=[U1], response=A1, prompt_token_ids=prompt)
    call = ToolCall(id="c1", function=FunctionCall(name="search", arguments='{"q": "Oslo"}'))
    t2 = example_turn(
        "oc",
        2,
        messages=[U1, A1, Message(role="user", content="And Oslo?")],
        response=Message(role="assistant", content="", tool_calls=[call]),
        finish_reason="tool_calls",
    )
    await publish(kafka, [t1, t2])
    now = time.time()
    async with EventProducer(kafka) as producer:
        state = [Message(role="user", content="And Oslo?")]
        await producer.send(TURNS_PAIRED, PairedTurn(turn=t1, next_state=state, paired_at=now), "oc")
        await producer.send(
            TURNS_PAIRED,
            PairedTurn(turn=t2, next_state=None, paired_at=now, terminal_reason="session_done"),
            "oc",
        )
    out = tmp_path / "openclaw.jsonl"
    r = cli(
        "export",
        "--out",
        str(out),
        "--format",
        "openclaw",
        "--tokenizer",
        str(smollm2_path),
        kafka=kafka,
        redis=redis_config,
    )
    assert r.returncode == 0, r.stderr
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert [(x["session_id"], x["turn"]) for x in rows] == [("oc", 1), ("oc", 2)]
    assert set(rows[0]) == {
        "session_id",
        "turn",
        "timestamp",
        "messages",
        "prompt_text",
        "response_text",
        "tool_calls",
        "next_state",
    }
    assert rows[0]["prompt_text"] == tok.decode(prompt) and "Eiffel" in rows[0]["prompt_text"]
    assert rows[0]["response_text"] == tok.decode(t1.response_token_ids), (
        "as generated, special tokens and all"
    )
    assert rows[0]["next_state"] == {"role": "user", "content": "And Oslo?"}, "OpenClaw's shape: the message"
    assert rows[1]["tool_calls"][0]["function"]["name"] == "search" and rows[1]["next_state"] is None

    # What OpenClaw-RL's proxy writes (OPENCLAW_RECORD_ENABLED=1): three turns, the next state as the next message
    # (an object) and null for the last, the response as the template renders it, end token and newline included;
    # and one record as turnstream's export wrote it before (next state a string, no end token). They become
    # turns of the current policy, the response ids exactly the tokens the model generated, scored by the engine.
    history = [*messages, {"role": "assistant", "content": "Paris."}, {"role": "user", "content": "Thanks"}]
    foreign = tmp_path / "foreign.jsonl"
    foreign.write_text(
        "\n".join(
            json.dumps(x)
            for x in [
                {"session_id": "f", "turn": 1, "timestamp": "2026-11-30 10:00:00", "messages": messages,
                 "prompt_text": tok.decode(prompt), "response_text": "Paris.<|im_end|>\n", "tool_calls": None,
                 "next_state": {"role": "user", "content": "Thanks"}},
                {"session_id": "f", "turn": 3, "timestamp": "2026-11-30 10:00:09", "messages": [*history,
                 {"role": "assistant", "content": "You're welcome!"}, {"role": "user", "content": "Bye"}],
                 "prompt_text": "", "response_text": "Goodbye!<|im_end|>\n", "tool_calls": None, "next_state": None},
                {"session_id": "f", "turn": 2, "timestamp": "2026-11-30 10:00:05", "messages": history,
                 "prompt_text": "", "response_text": "You're welcome!<|im_end|>\n", "tool_calls": None,
                 "next_state": {"role": "user", "content": "Bye"}},
                {"session_id": "old", "turn": 0, "messages": messages, "prompt_text": "", "response_text": "Paris.",
                 "tool_calls": None, "next_state": "Thanks"},
            ]
        )
    )  # fmt: skip
    target = other_namespace(kafka, "oc-import")
    r = cli("import", "--input", str(foreign), "--into", target.namespace, "--engine-url", engine.url,
            kafka=kafka, redis=redis_config)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["rescored"] == 4
    imported = await turns_of(target)
    got = {t.turn_index: t for t in imported if t.session_id == "f"}
    assert sorted(got) == [1, 2, 3] and got[3].session_done and not got[1].session_done
    assert [got[i].response.content for i in (1, 2, 3)] == ["Paris.", "You're welcome!", "Goodbye!"]
    assert got[1].prompt_token_ids == prompt and got[1].token_source == "retokenized"
    paris = [*tok("Paris.", add_special_tokens=False).input_ids, tok.eos_token_id]
    assert got[1].response_token_ids == paris, (
        "up to the end token; the template's newline after it is not generated"
    )
    assert len(got[1].response_logprobs) == len(got[1].response_token_ids)
    assert all(lp <= 0.0 for lp in got[1].response_logprobs) and any(
        lp < -0.01 for lp in got[1].response_logprobs
    )
    old = next(t for t in imported if t.session_id == "old")
    assert old.response_token_ids == paris and old.response.content == "Paris." and old.session_done

    # Without an engine, OpenClaw records are refused with the reason, not half imported.
    r = cli("import", "--input", str(foreign), "--into", target.namespace, "--engine-url", "http://127.0.0.1:9",
            "--tokenizer", str(smollm2_path), kafka=kafka, redis=redis_config)  # fmt: skip
    assert r.returncode == 2 and "Traceback" not in r.stderr


async def test_derive_reruns_the_pipeline_into_a_new_namespace(
    kafka: KafkaConfig, redis_config: RedisConfig, tmp_path: Path
) -> None:
    recorded = (
        session("good", "Thanks, that works.", done=True)
        + session("bad", "That's wrong, I meant the one in Las Vegas.", done=True)
        + session("open", "Tell me more about it.", done=False)
    )
    await publish(kafka, recorded)
    into = other_namespace(kafka, "rederived").namespace
    r = cli(
        "derive", "--into", into, "--mode", "rl", "--judge-backend", "rules", "--judge-id", "replayed",
        "--idle-timeout", "1", "--run-dir", str(tmp_path / "logs"), "--timeout", "300",
        kafka=kafka, redis=redis_config,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr + "".join(p.read_text() for p in (tmp_path / "logs").glob("*.log"))
    summary = json.loads(r.stdout)
    target = msgspec.structs.replace(kafka, namespace=into)
    assert summary["copied_turns"] == 6 and summary["paired"] == 6 and summary["deadletters"] == 0

    paired = [r.event async for r in read_topic(target, TURNS_PAIRED)]
    assert sorted(p.turn_id for p in paired) == sorted(t.turn_id for t in recorded)  # each turn paired once
    assert {p.turn_id: p.terminal_reason for p in paired if p.terminal}["open:2"] == "idle_timeout"
    judgments = [r.event async for r in read_topic(target, JUDGMENTS)]
    assert judgments and {j.judge_id for j in judgments} == {"replayed"}
    samples = {s.sample_id: s for s in [r.event async for r in read_topic(target, SAMPLES)]}
    assert {s.kind for s in samples.values()} == {"rl"}
    assert samples["good:1"].reward == 1.0 and samples["bad:1"].reward == -1.0
    assert set(samples) <= {"good:1", "bad:1", "open:1"}
    # The source namespace was only read.
    assert sorted(await turns_of(kafka), key=lambda t: t.turn_id) == sorted(recorded, key=lambda t: t.turn_id)
    assert [r async for r in read_topic(kafka, TURNS_PAIRED)] == []

    # Into the source namespace: refused.
    r = cli("derive", "--into", kafka.namespace, kafka=kafka, redis=redis_config)
    assert r.returncode == 1 and "namespace other than the source" in r.stderr


async def test_drive_sends_recorded_user_messages_through_the_proxy(
    kafka: KafkaConfig, redis_config: RedisConfig, tmp_path: Path, proxy_env: dict[str, str]
) -> None:
    t1 = example_turn("trip", 1, messages=[U1], response=A1)
    t2 = example_turn(
        "trip", 2,
        messages=[U1, Message(role="assistant", content="Elsewhere."), Message(role="user", content="And its height?")],
        response=Message(role="assistant", content="330 m."),
    )  # fmt: skip
    t3 = example_turn(
        "trip", 3,
        messages=[*t2.messages, t2.response, Message(role="user", content="Thanks!")],
        response=Message(role="assistant", content="You're welcome."),
    )  # fmt: skip
    call = ToolCall(id="c1", function=FunctionCall(name="search", arguments="{}"))
    tool1 = example_turn("tools", 1, messages=[U1], response=Message(role="assistant", tool_calls=[call]))
    tool2 = example_turn(
        "tools", 2,
        messages=[U1, tool1.response, Message(role="tool", content="Paris", tool_call_id="c1")],
        response=A1,
    )  # fmt: skip
    await publish(kafka, [t1, t2, t3, tool1, tool2])

    fresh = other_namespace(kafka, "redriven")
    await create_topics(fresh, partitions=3)
    proxy = ProxyProcess({**proxy_env, "TURNSTREAM_KAFKA_NAMESPACE": fresh.namespace})
    try:
        r = cli("drive", "--proxy-url", proxy.url + "/v1", "--tag", "t1", "--max-tokens", "8",
                kafka=kafka, redis=redis_config)  # fmt: skip
        assert r.returncode == 0, r.stderr
        summary = json.loads(r.stdout)
        assert summary["turns_sent"] == 4 and summary["sessions_cut_at_tool_results"] == 1

        # The same sessions from an OpenClaw file.
        rows = [{"session_id": t.session_id, "turn": t.turn_index, "messages": msgspec.to_builtins(t.messages),
                 "prompt_text": "", "response_text": "", "tool_calls": None, "next_state": None}
                for t in (t1, t2, t3)]  # fmt: skip
        jsonl = tmp_path / "oc.jsonl"
        jsonl.write_text("\n".join(json.dumps(x) for x in rows))
        r = cli("drive", "--proxy-url", proxy.url + "/v1", "--input", str(jsonl), "--tag", "t2",
                "--max-tokens", "8", kafka=kafka, redis=redis_config)  # fmt: skip
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["turns_sent"] == 3
    finally:
        proxy.stop()

    turns = {t.turn_id: t for t in await wait_for_events(fresh, TURNS, lambda ts: len(ts) >= 7)}
    assert sorted(turns) == [
        "tools~t1:1",
        "trip~t1:1",
        "trip~t1:2",
        "trip~t1:3",
        "trip~t2:1",
        "trip~t2:2",
        "trip~t2:3",
    ]
    second = turns["trip~t1:2"]
    # The fresh answer, not the recorded one, is in the history; the user's recorded follow-up comes after it.
    assert second.messages[0] == U1 and second.messages[1] == turns["trip~t1:1"].response
    assert second.messages[2] == Message(role="user", content="And its height?")
    assert turns["trip~t1:3"].session_done and not second.session_done
    assert turns[
        "tools~t1:1"
    ].session_done  # cut before the tool result: the session ends at its last sent turn

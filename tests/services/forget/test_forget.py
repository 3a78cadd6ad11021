"""``turnstream forget``, run as an operator runs it, after a person's conversations have spread through the real
proxy, Kafka, Redis, the pairer, a dead letter, a replay namespace and the console's projection: nothing of them
can be read anywhere afterwards, byte for byte, and another person's data is untouched."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import msgspec
import pytest
from redis import asyncio as aioredis

from runtime.configuration.config import Config, KafkaConfig, RedisConfig
from runtime.messaging.bus import EventProducer, read_topic
from runtime.messaging.topics import create_topics, list_topic_names
from runtime.security.erasure.sealing import seal_value
from schemas.topics import SESSIONS_ENDED as TURNS_ENDED
from schemas.topics import TURNS
from services.console.feed import follow
from services.console.projection import connect, session_rows
from services.forget.topics import private_topics, raw_records
from tests.metrics import scraped
from tests.services.proxy.conftest import StubProxy, pair_all, wait_for_turns

pytestmark = pytest.mark.integration

SECRET = f"the vault code is {uuid.uuid4().hex[:8]}-ZEBRA"
"""Unique to the run: the test Redis keeps its data between runs (append-only file), and a run that failed before
``forget`` left its words there for their TTL, which every later run's database-wide search would find."""


def chat(proxy: StubProxy, key: str, messages: list[dict[str, str]], session: str | None = None) -> str:
    headers = {"Authorization": f"Bearer {key}", **({"X-Session-Id": session} if session else {})}
    r = httpx.post(
        proxy.url + "/v1/chat/completions",
        json={"messages": messages, "max_tokens": 4},
        headers=headers,
        timeout=60,
    )
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["message"]["content"])


async def everything_raw(kafka: KafkaConfig) -> list[bytes]:
    """Keys and values of every record on every topic that holds conversations, in every namespace."""
    out: list[bytes] = []
    for name, _ in private_topics(await list_topic_names(kafka), [kafka.namespace]):
        async for rec in raw_records(kafka, name):
            out += [rec.key or b"", rec.value or b""]
    return out


async def redis_mentions(r: aioredis.Redis, needles: list[str]) -> list[str]:
    """Every key whose name or string value holds one of ``needles``, anywhere in the database."""
    found = []
    async for name in r.scan_iter(count=1000):
        text = name.decode("utf-8", "replace")
        value = await r.get(name) if await r.type(name) == b"string" else b""
        if any(n in text or n.encode() in (value or b"") for n in needles):
            found.append(text)
        elif await r.type(name) == b"zset":
            members = [m.decode("utf-8", "replace") async for m, _ in r.zscan_iter(name)]
            found += [f"{text} {m}" for m in members if any(n in m for n in needles)]
    return found


async def test_forget_leaves_no_trace_of_a_users_sessions_and_keeps_everyone_elses(
    kafka: KafkaConfig, redis_config: RedisConfig, tmp_path: Path
) -> None:
    keys = tmp_path / "keys"
    keys.write_text("alice alice-key-0123456789abcdef\nbob bob-key-0123456789abcdef\n")
    keys.chmod(0o600)
    proxy = StubProxy(kafka, redis_config, tmp_path, TURNSTREAM_PROXY_KEYS_FILE=str(keys))
    alice, bob = f"alice-{uuid.uuid4().hex[:8]}", f"bob-{uuid.uuid4().hex[:8]}"
    try:
        for i in range(3):  # a session with an id, and one the proxy infers (a stock client sends none)
            chat(proxy, "alice-key-0123456789abcdef", [{"role": "user", "content": f"{SECRET} #{i}"}], alice)
        stored = httpx.post(  # a Responses API turn, stored (the default) for previous_response_id
            proxy.url + "/v1/responses",
            json={"input": f"{SECRET} once more", "max_output_tokens": 4},
            headers={"Authorization": "Bearer alice-key-0123456789abcdef", "X-Session-Id": alice},
            timeout=60,
        )
        assert stored.status_code == 200, stored.text
        side = httpx.post(  # a side continuation of it (Codex's compaction), stored too: a copy of her words
            proxy.url + "/v1/responses",
            json={"previous_response_id": stored.json()["id"], "input": "Summarise.", "max_output_tokens": 4},
            headers={"Authorization": "Bearer alice-key-0123456789abcdef", "X-Turn-Type": "side"},
            timeout=60,
        )
        assert side.status_code == 200, side.text
        history = [{"role": "user", "content": f"{SECRET}, remember it"}]
        for i in range(2):
            history.append(
                {"role": "assistant", "content": chat(proxy, "alice-key-0123456789abcdef", history)}
            )
            history.append({"role": "user", "content": f"and again {i}"})
        for i in range(2):
            chat(proxy, "bob-key-0123456789abcdef", [{"role": "user", "content": f"bob's question {i}"}], bob)
    finally:
        proxy.proxy.stop()
        proxy.stub.stop()
    turns = await wait_for_turns(kafka, 8)
    alice, bob = f"alice/{alice}", f"bob/{bob}"  # recorded in each user's namespace
    alices = sorted({t.session_id for t in turns if t.user == "alice"})
    assert len(alices) == 2 and alice in alices and all(t.user == "bob" for t in turns if t.session_id == bob)

    config = Config(kafka=kafka, redis=redis_config)
    await pair_all(config, expect=5)  # 3 + 1 + 1 pairs; each session's last turn waits in Redis
    async with EventProducer(kafka) as producer:  # a record the pairer cannot use: dead-lettered
        bad = await seal_value(kafka, TURNS, alice.encode(), b"\x81\xa4type\xa4none")
        await producer.send_raw(TURNS.name(kafka.namespace), bad, alice.encode())
        replay = msgspec.structs.replace(kafka, namespace=f"{kafka.namespace}replay.")
        await create_topics(replay)
    async with EventProducer(replay) as producer:  # a replay namespace's copy
        for t in turns:
            await producer.send(TURNS, t, t.session_id)
    await pair_all(config, expect=5)  # the bad record is dead-lettered on the way
    projection = tmp_path / "console" / "live.sqlite3"
    db, stop, caught_up = connect(projection), asyncio.Event(), asyncio.Event()
    feed = asyncio.create_task(follow(kafka, db, stop, caught_up=caught_up))
    await asyncio.wait_for(caught_up.wait(), 60)
    stop.set()
    await feed
    db.close()

    r = aioredis.from_url(redis_config.url)
    try:
        # Before: the conversations are in Redis (the pairer's open turn, in the clear), the projection, and
        # readable on every topic (sealed: the log's bytes never show them).
        assert await redis_mentions(r, alices) and await redis_mentions(r, [SECRET])
        assert any(":resp:" in name or "resp:" in name for name in await redis_mentions(r, alices))
        # Stored responses, the side continuation's included, are sealed (issue 55: it was in the clear).
        assert not [name for name in await redis_mentions(r, [SECRET]) if "resp:" in name]
        assert SECRET.encode() in b"".join(p.read_bytes() for p in projection.parent.glob("live.sqlite3*"))
        assert not any(SECRET.encode() in raw for raw in await everything_raw(kafka))
        argv = [
            sys.executable,
            "-m",
            "services.cli",
            "forget",
            "--user",
            "alice",
            "--projection",
            str(projection),
        ]
        argv += ["--namespace", kafka.namespace, "--namespace", replay.namespace, "--wait", "1"]
        out = await asyncio.to_thread(
            subprocess.run,
            argv,
            env={
                **os.environ,
                **kafka.client_env(),
                "TURNSTREAM_REDIS_URL": redis_config.url,
                "TURNSTREAM_REDIS_KEY_PREFIX": redis_config.key_prefix,
                "TURNSTREAM_LOGGING_FORMAT": "text",
            },
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert out.returncode == 0, (out.stdout[-3000:], out.stderr[-3000:])
        report = json.loads(out.stdout)
        assert report["erased"] and report["sessions"] == alices and report["keys_destroyed"] == 2
        left = {t["topic"]: t for t in report["topics"]}
        assert (
            left[TURNS.name(kafka.namespace)]["sealed"] == 7
            and left[TURNS.name(replay.namespace)]["sealed"] == 6
        )
        assert left[f"{kafka.namespace}turns.paired"]["sealed"] >= 4
        assert left[f"{kafka.namespace}deadletter"]["sealed"] == 1
        assert all(t["readable"] == 0 and t["clear"] == 0 for t in report["topics"])

        # After, checked here independently of the command's own proof: no reader gets alice's records (a reader
        # that has not held her key: this process did, for the cache time)...
        for ns in (kafka, replay):
            fresh = msgspec.structs.replace(ns, seal_keys_cache_s=0.25)
            assert {rec.event.user async for rec in read_topic(fresh, TURNS)} == {"bob"}
        # ...nothing in Redis names her sessions or holds her words, and bob's state is still there...
        assert await redis_mentions(r, [*alices, SECRET]) == []
        assert await redis_mentions(r, [bob])
    finally:
        await r.aclose()
    # ...and the console's projection has no row of hers and none of her words on disk (WAL included).
    db = connect(projection, readonly=True)
    assert session_rows(db, set(alices)) == 0 and session_rows(db, {bob}) >= 2
    db.close()
    assert all(SECRET.encode() not in p.read_bytes() for p in projection.parent.glob("live.sqlite3*"))


@pytest.mark.parametrize(
    "keys_apart", [False, True], ids=["keys-beside-turn-numbers", "keys-in-their-own-redis"]
)
async def test_a_forgotten_session_is_fenced_so_nothing_comes_back_readable(
    kafka: KafkaConfig, redis_config: RedisConfig, tmp_path: Path, keys_apart: bool
) -> None:
    """Issue 42: a turn written while ``turnstream forget`` ran came back readable under a fresh key (the report
    said ``erased: false``, but nothing stopped it). Now forgetting fences the session in the same step as its key
    goes: a turn that was still in the proxy's spool is dropped when it is published (counted), a new turn under
    the id is a 410 ``session_forgotten`` (streamed too), a record any service writes for it is not written
    (counted), and once the fence expires the id starts a new session under a new key. The proxy learns of the
    fence from its turn numbering when the data keys share that Redis, else from the keys' own (the same server
    named apart here, as a deployment with a Redis of its own for the keys would)."""
    from services.forget.main import forget

    if keys_apart:
        kafka = msgspec.structs.replace(
            kafka, seal_keys_url=redis_config.url.replace("127.0.0.1", "localhost")
        )

    proxy = StubProxy(
        kafka,
        redis_config,
        tmp_path,
        TURNSTREAM_PROXY_SPOOL_LINGER_MS="4000",  # the turn is still on its way while forget runs
        TURNSTREAM_KAFKA_SEAL_KEYS_CACHE_S="1",
        TURNSTREAM_KAFKA_SEAL_KEYS_URL=kafka.seal_keys_url,
    )
    url, sid = proxy.url + "/v1/chat/completions", f"fenced-{uuid.uuid4().hex[:8]}"
    body = {"messages": [{"role": "user", "content": SECRET}], "max_tokens": 2}
    try:
        assert httpx.post(url, json=body, headers={"X-Session-Id": sid}, timeout=30).status_code == 200
        config = Config(kafka=kafka, redis=redis_config)
        assert config.kafka.seal_keys_url != config.redis.url or not keys_apart
        report = await forget(
            config,
            {sid},
            namespaces=[kafka.namespace],
            projections=[],
            delete_rows=lambda *_: 0,
            count_rows=lambda *_: 0,
            wait_s=1.5,
            fence_s=8,
        )
        assert report.sessions == [sid]  # its key made by now, or not yet (the turn still in the spool)
        for stream in (False, True):
            r = httpx.post(url, json={**body, "stream": stream}, headers={"X-Session-Id": sid}, timeout=30)
            assert r.status_code == 410 and r.json()["error"]["code"] == "session_forgotten", r.text
            assert sid in r.json()["error"]["message"]
        async with EventProducer(kafka) as producer:  # any service's write for it, e.g. the pairer's end
            from schemas import SessionEnded

            assert (
                await producer.send(
                    TURNS_ENDED, SessionEnded(session_id=sid, after_turn_index=1, ended_at=1.0), sid
                )
                is None
            )
        deadline = time.monotonic() + 60  # the spooled turn's publish: dropped
        while scraped(proxy.url, "turnstream_bus_forgotten_total", topic=TURNS.name(kafka.namespace)) < 1:
            assert time.monotonic() < deadline, "the spooled turn of a forgotten session was never dropped"
            await asyncio.sleep(0.2)
        forgotten = scraped(proxy.url, "turnstream_bus_forgotten_total", topic=TURNS.name(kafka.namespace))
        assert forgotten == 1
        fresh = msgspec.structs.replace(kafka, seal_keys_cache_s=0.25)
        assert [e async for e in read_topic(fresh, TURNS) if e.event.session_id == sid] == []
        assert [e async for e in read_topic(fresh, TURNS_ENDED) if e.event.session_id == sid] == []
        # The fence expires: the id is a new session, readable under its new key.
        await asyncio.sleep(6)
        assert httpx.post(url, json=body, headers={"X-Session-Id": sid}, timeout=30).status_code == 200
        turns = await wait_for_turns(fresh, 1, timeout=30)
        assert [t.session_id for t in turns] == [sid]
    finally:
        proxy.close()


def test_a_path_that_is_not_a_projection_is_refused_before_anything_is_destroyed(tmp_path: Path) -> None:
    """A mistyped ``--projection`` used to end ``forget`` in a traceback after the keys were destroyed (SQLite
    makes an empty file of a missing path): now every path is checked first, and the command exits 2 naming it."""
    from services.forget.main import not_projections

    real = tmp_path / "live.sqlite3"
    connect(real).close()
    (tmp_path / "empty.sqlite3").touch()
    (tmp_path / "junk.sqlite3").write_text("junk")
    paths = [real, tmp_path / "empty.sqlite3", tmp_path / "junk.sqlite3", tmp_path / "missing.sqlite3"]
    bad = not_projections(paths)
    assert [b.split(":")[0] for b in bad] == [str(p) for p in paths[1:]]
    assert not (tmp_path / "missing.sqlite3").exists()
    out = subprocess.run(
        [sys.executable, "-m", "services.cli", "forget", "--session", "s", "--projection", str(paths[3])],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and "no such file" in out.stderr and "Traceback" not in out.stderr

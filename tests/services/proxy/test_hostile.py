"""Hostile input against a live proxy (in front of the stub engine, Kafka recording on): fuzzed bodies and headers
(hypothesis), raw bytes, and the classic abuses. The proxy never answers 5xx (the stub engine never fails), every
error has OpenAI's shape, nothing reaches the unexpected-error handler, and it keeps serving."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runtime.configuration.config import KafkaConfig, RedisConfig
from runtime.process.launch import ServiceProcess
from runtime.process.ports import free_port
from schemas import encode
from tests.metrics import scraped
from tests.services.proxy.conftest import StubProxy, assert_still_serving, check, wait_for_turns

pytestmark = pytest.mark.integration


def post_raw(proxy: StubProxy, raw: bytes) -> httpx.Response:
    """The bytes as a chat request body, exactly as given."""
    return httpx.post(
        proxy.url + "/v1/chat/completions",
        content=raw,
        headers={"content-type": "application/json"},
        timeout=60,
    )


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
roles = st.sampled_from(["system", "user", "assistant", "tool", "developer"]) | st.text(max_size=8)
messages = st.lists(
    st.fixed_dictionaries(
        {"role": roles},
        optional={
            "content": st.text(max_size=40) | json_values,
            "tool_calls": json_values,
            "tool_call_id": json_values,
            "name": json_values,
        },
    ),
    max_size=4,
)
chat_bodies = st.fixed_dictionaries(
    {"messages": messages | json_values},
    optional={
        "model": json_values,
        "stream": st.booleans() | json_values,
        "max_tokens": st.integers() | json_values,
        "temperature": st.floats(allow_nan=False, allow_infinity=False) | json_values,
        "top_p": st.floats(allow_nan=False, allow_infinity=False) | json_values,
        "n": st.integers(-2, 4) | json_values,
        "seed": st.integers() | json_values,
        "stop": json_values,
        "tools": json_values,
        "tool_choice": json_values,
        "logprobs": json_values,
        "top_logprobs": json_values,
        "session_id": json_values,
        "turn_type": json_values,
        "session_done": json_values,
    },
)
header_text = st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=300).map(str.strip)
headers = st.fixed_dictionaries(
    {},
    optional={
        "X-Session-Id": header_text,
        "X-Turn-Type": st.sampled_from(["main", "side", "MAIN", "", "other"]) | header_text,
        "X-Session-Done": st.sampled_from(["true", "false", "1", "yes", ""]) | header_text,
        "Authorization": header_text,
    },
)

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@FUZZ
@given(body=chat_bodies, extra=headers)
def test_fuzzed_chat_requests_get_answers_or_openai_errors(
    stub_proxy: StubProxy, body: dict[str, Any], extra: dict[str, str]
) -> None:
    r = httpx.post(stub_proxy.url + "/v1/chat/completions", json=body, headers=extra, timeout=30)
    check(r)


@FUZZ
@given(raw=st.binary(max_size=300) | json_values.map(lambda v: httpx.Request("POST", "/", json=v).content))
def test_fuzzed_raw_bodies_get_openai_errors(stub_proxy: StubProxy, raw: bytes) -> None:
    r = post_raw(stub_proxy, raw)
    check(r)
    assert r.status_code in (200, 400)


ABUSE: list[tuple[str, bytes, int, str]] = [
    (
        "deeply nested",
        b'{"messages": [{"role": "user", "content": ' + b"[" * 20_000 + b"]" * 20_000 + b"}]}",
        400,
        "nested",
    ),
    ("invalid UTF-8", b'{"messages": [{"role": "user", "content": "\xc3\x28"}]}', 400, "JSON"),
    ("oversized", b'{"messages": [{"role": "user", "content": "' + b"x" * 70_000 + b'"}]}', 413, "exceeds"),
    (
        "absurd max_tokens",
        b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 100000000000000}',
        400,
        "max_tokens",
    ),
    (
        "huge integer",
        b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 1' + b"0" * 400 + b"}",
        400,
        "",
    ),
    (
        "negative max_tokens",
        b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": -5}',
        400,
        "max_tokens",
    ),
    (
        "negative temperature",
        b'{"messages": [{"role": "user", "content": "x"}], "temperature": -0.5}',
        400,
        "temperature",
    ),
    (
        "non-numeric temperature",
        b'{"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}',
        400,
        "temperature",
    ),
    ("boolean top_p", b'{"messages": [{"role": "user", "content": "x"}], "top_p": true}', 400, "top_p"),
    (
        "infinite top_p",
        b'{"messages": [{"role": "user", "content": "x"}], "top_p": 1e400}',
        400,
        "out of range",
    ),
    # Inside OpenAI's ranges but refused by SGLang: the proxy's own 400, never the engine's.
    (
        "zero top_p",
        b'{"messages": [{"role": "user", "content": "x"}], "top_p": 0}',
        400,
        "'top_p' must be in (0",
    ),
    (
        "zero top_k",
        b'{"messages": [{"role": "user", "content": "x"}], "top_k": 0}',
        400,
        "'top_k' must be -1",
    ),
    (
        "zero repetition_penalty",
        b'{"messages": [{"role": "user", "content": "x"}], "repetition_penalty": 0.0}',
        400,
        "'repetition_penalty' must be in (0",
    ),
    ("content of a wrong type", b'{"messages": [{"role": "user", "content": 5}]}', 400, "content"),
    (
        "null byte session",
        b'{"messages": [{"role": "user", "content": "x"}], "session_id": "a\\u0000b"}',
        400,
        "ession",
    ),
]


@pytest.mark.parametrize(("name", "raw", "status", "needle"), ABUSE, ids=[a[0] for a in ABUSE])
def test_abuse_is_refused_clearly_and_the_proxy_keeps_serving(
    stub_proxy: StubProxy, name: str, raw: bytes, status: int, needle: str
) -> None:
    r = post_raw(stub_proxy, raw)
    check(r)
    assert r.status_code == status, r.text[:300]
    assert needle in r.json()["error"]["message"]
    assert_still_serving(stub_proxy.url)


async def test_no_secret_reaches_the_logs_or_the_events(
    kafka: KafkaConfig, redis_config: RedisConfig, tmp_path: Path
) -> None:
    """The proxy's API key, the engine's API key and a wrong key a client sent: in no log line (DEBUG level), no
    response and no recorded event. (``config show`` masks them too: tests/runtime/configuration/test_config.py.)"""
    from runtime.messaging.bus import read_topic
    from schemas.topics import TURNS

    secrets = {"proxy": "sk-proxy-5ecret", "engine": "sk-engine-5ecret", "wrong": "sk-wrong-5ecret"}
    proxy = StubProxy(
        kafka,
        redis_config,
        tmp_path,
        TURNSTREAM_PROXY_API_KEY=secrets["proxy"],
        TURNSTREAM_ENGINE_API_KEY=secrets["engine"],
        TURNSTREAM_LOGGING_LEVEL="DEBUG",
    )
    try:
        body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
        async with httpx.AsyncClient(timeout=30) as http:
            url = proxy.url + "/v1/chat/completions"
            denied = await http.post(url, json=body, headers={"Authorization": f"Bearer {secrets['wrong']}"})
            assert denied.status_code == 401 and secrets["wrong"] not in denied.text
            for i in range(3):
                ok = await http.post(
                    url,
                    json=body,
                    headers={"Authorization": f"Bearer {secrets['proxy']}", "X-Session-Id": f"sec-{i}"},
                )
                assert ok.status_code == 200 and not any(v in ok.text for v in secrets.values())
        for _ in range(50):
            raw = [encode(r.event) async for r in read_topic(kafka, TURNS)]
            if len(raw) == 3:
                break
            await asyncio.sleep(0.2)
        assert len(raw) == 3
        for event in raw:
            assert not any(v.encode() in event for v in secrets.values())
    finally:
        log = proxy.close()
    assert not any(v in log for v in secrets.values())


async def test_an_engine_that_breaks_off_mid_stream_gets_an_in_band_error_and_nothing_recorded(
    kafka: KafkaConfig, redis_config: RedisConfig, tmp_path: Path
) -> None:
    """Every second stream breaks: three events then one that is not JSON (sent at once), or three events then
    the engine's connection closes. The client gets the three events, then an error event and no [DONE]; the
    turn is not recorded but counted; the streams between are served and recorded in full."""
    proxy = StubProxy(kafka, redis_config, tmp_path, stub_args=("--break-every", "2"))
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 60, "stream": True}
    seen: list[tuple[list[str], bool, list[str]]] = []
    log = ""
    try:
        for i in range(4):
            with httpx.stream(
                "POST",
                proxy.url + "/v1/chat/completions",
                json=body,
                headers={"X-Session-Id": f"b{i}"},
                timeout=30,
            ) as r:
                assert r.status_code == 200
                data = [line[5:].strip() for line in r.iter_lines() if line.startswith("data:")]
            done = data[-1] == "[DONE]"
            events = [json.loads(d) for d in data if d != "[DONE]"]
            content = [c["delta"].get("content") or "" for e in events for c in e.get("choices", [])]
            errors = [e["error"]["type"] for e in events if "error" in e]
            seen.append((content, done, errors))
    finally:
        log = proxy.close(dropped=2)
    for content, done, errors in seen[0::2]:  # served whole
        assert ("".join(content), done, errors) == ("".join(f" w{i}" for i in range(60)), True, [])
    for content, done, errors in seen[1::2]:  # broken: what came before the break, then the error
        assert (content, done, errors) == (["", " w0", " w1"], False, ["engine_error"])
    assert "engine stream broke off" in log
    turns = await wait_for_turns(kafka, 2)
    assert sorted(t.session_id for t in turns) == ["b0", "b2"]
    assert all(len(t.response_token_ids) == 60 for t in turns)


def engine_connections(proxy: StubProxy) -> int:
    """The proxy's open TCP connections to the engine."""
    import psutil

    engine_port = int(proxy.stub.url.rsplit(":", 1)[1])
    conns = psutil.Process(proxy.proxy.proc.pid).net_connections(kind="tcp")
    return sum(1 for c in conns if c.raddr and c.raddr.port == engine_port and c.status == "ESTABLISHED")


def test_a_session_id_beyond_ascii_is_a_400_before_the_engine_is_asked(stub_proxy: StubProxy) -> None:
    """Issue 32, item 4: ``caf€-1`` used to fail only when copied into the response header, after the engine did
    the work: a 500, and each streamed request left an engine connection open. Now it is a 400 at once."""
    body = {"messages": [{"role": "user", "content": "hi"}], "stream": True}
    for i in range(10):
        r = httpx.post(
            stub_proxy.url + "/v1/chat/completions",
            json=body if i % 2 else {**body, "session_id": f"caf€-{i}"},
            headers={"X-Session-Id": f"caf€-{i}".encode()} if i % 2 else {},
            timeout=30,
        )
        check(r)
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_session", r.text
        assert "printable ASCII" in r.json()["error"]["message"]
    assert engine_connections(stub_proxy) <= 1
    assert_still_serving(stub_proxy.url)


def test_json_nested_deep_inside_a_string_field_is_data_not_a_500(stub_proxy: StubProxy) -> None:
    """Issue 55, row 5: JSON in a string (Claude Code's ``metadata.user_id``, Codex's ``x-codex-turn-metadata``,
    a tool call's ``arguments`` in the history) is one value to the body's limits, so it may nest past Python's
    recursion limit: each was a 500 with a logged traceback. Such a string is no session id, no side-call label and
    no JSON arguments, as any other that does not parse: the request is served, the proxy's log holds no traceback."""
    deep = "[" * 5000 + "]" * 5000
    meta = '{"session_id": ' + deep + "}"
    history = [
        {"role": "user", "content": "hi"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": deep}}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "ok"},
    ]
    requests = [
        (
            "/v1/messages",
            {"max_tokens": 4, "metadata": {"user_id": meta}, "messages": [{"role": "user", "content": "hi"}]},
        ),
        (
            "/v1/responses",
            {"input": "hi", "max_output_tokens": 4, "client_metadata": {"x-codex-turn-metadata": deep}},
        ),
        ("/v1/chat/completions", {"messages": history, "max_tokens": 4}),
    ]
    for path, body in requests:
        r = httpx.post(stub_proxy.url + path, json=body, headers=stub_proxy.auth, timeout=30)
        assert r.status_code == 200, (path, r.text[:300])
    assert (
        "RecursionError" not in Path(stub_proxy.proxy.logfile.name).read_text()
    )  # the fixture checks the rest


def test_a_main_turn_too_large_to_record_is_a_413_naming_the_limit(
    kafka: KafkaConfig, redis_config: RedisConfig, tmp_path: Path
) -> None:
    """Issue 32, item 1: a main turn is recorded, and its record (and the pairing and judgment that embed it) must
    fit Kafka's limit, so its request has a limit of its own (``proxy.max_turn_bytes``), refused before the
    engine is asked. A side turn, never recorded, keeps the body limit."""
    proxy = StubProxy(kafka, redis_config, tmp_path, TURNSTREAM_PROXY_MAX_TURN_BYTES="20000")
    try:
        big = {"messages": [{"role": "user", "content": "hi", "name": "x" * 30_000}], "max_tokens": 2}
        r = httpx.post(proxy.url + "/v1/chat/completions", json=big, timeout=30)
        check(r)
        assert r.status_code == 413 and r.json()["error"]["code"] == "turn_too_large", r.text
        assert "at most 20000 bytes" in r.json()["error"]["message"]
        side = httpx.post(
            proxy.url + "/v1/chat/completions", json=big, headers={"X-Turn-Type": "side"}, timeout=30
        )
        assert side.status_code == 200, side.text[:300]
        assert_still_serving(proxy.url)
    finally:
        proxy.close()


def _host_port(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").split(":")
    return host, int(port)


async def _closed_by_peer(reader: asyncio.StreamReader, within_s: float) -> bytes | None:
    """Whatever the server sent before it closed the connection, or None if it is still open after ``within_s``."""
    try:
        async with asyncio.timeout(within_s):
            return await reader.read()
    except TimeoutError:
        return None
    except ConnectionResetError:
        return b""


async def test_half_sent_requests_are_closed_and_real_ones_still_served(
    kafka: KafkaConfig, redis_config: RedisConfig, tmp_path: Path
) -> None:
    """Issue 32, item 7: half-sent requests held connections forever. Now a head that does not arrive within
    ``proxy.head_timeout_s``, or a body that does not arrive within ``proxy.body_timeout_s`` of its head (a 408),
    closes the connection; a head over ``max_head_bytes`` is a 431; and each is counted."""
    proxy = StubProxy(
        kafka,
        redis_config,
        tmp_path,
        TURNSTREAM_PROXY_HEAD_TIMEOUT_S="1",
        TURNSTREAM_PROXY_BODY_TIMEOUT_S="2",
        TURNSTREAM_PROXY_MAX_HEAD_BYTES="16384",
    )
    host, port = _host_port(proxy.url)
    try:
        heads = [await asyncio.open_connection(host, port) for _ in range(30)]
        for i, (_, writer) in enumerate(heads):
            if i % 2:  # half of them send part of a head, the rest nothing at all
                writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
        body_reader, body_writer = await asyncio.open_connection(host, port)
        body_writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 500\r\n\r\n" + b'{"messages": ['
        )
        began = asyncio.get_running_loop().time()
        closed = await asyncio.gather(*(_closed_by_peer(r, 5) for r, _ in heads))
        assert all(c is not None for c in closed), "a half-sent head was still open after 5 s"
        assert asyncio.get_running_loop().time() - began < 4
        # The body's deadline counts from its head: an OpenAI-shaped 408, then the connection closes.
        answer = await _closed_by_peer(body_reader, 5)
        assert answer is not None and answer.startswith(b"HTTP/1.1 408 "), answer
        error = json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]
        assert error["code"] == "request_timeout" and "2 s" in error["message"]
        # A head past the size limit is a 431 at once, not a wait for the deadline.
        big_reader, big_writer = await asyncio.open_connection(host, port)
        big_writer.write(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Junk: " + b"a" * 20_000 + b"\r\n")
        answer = await _closed_by_peer(big_reader, 0.9)
        assert answer is not None and answer.startswith(b"HTTP/1.1 431 "), answer
        for _, w in [*heads, (body_reader, body_writer), (big_reader, big_writer)]:
            w.close()
        assert_still_serving(proxy.url)
        refused = "turnstream_http_connections_refused_total"
        assert scraped(proxy.url, refused, reason="head_timeout") == 30
        assert scraped(proxy.url, refused, reason="body_timeout") == 1
        assert scraped(proxy.url, refused, reason="head_too_large") == 1
    finally:
        proxy.close()


async def _hoard(host: str, port: int, count: int, source: str) -> list[asyncio.StreamWriter]:
    """``count`` connections from ``source`` that never send a byte."""
    held = []
    for _ in range(count):
        _, writer = await asyncio.open_connection(host, port, local_addr=(source, 0))
        held.append(writer)
    return held


async def _served(url: str, requests: int) -> int:
    """How many of ``requests`` plain chat requests, each on a new connection from 127.0.0.1, get a 200."""
    ok = 0
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    for i in range(requests):
        async with httpx.AsyncClient(timeout=10) as client:
            with contextlib.suppress(httpx.TransportError):
                r = await client.post(
                    url + "/v1/chat/completions", json=body, headers={"X-Session-Id": f"v{i}"}
                )
                ok += r.status_code == 200
    return ok


@pytest.mark.parametrize("per_address", [16, 0], ids=["per-address-cap", "total-cap-only"])
async def test_one_address_hoarding_idle_connections_locks_nobody_out(
    kafka: KafkaConfig, redis_config: RedisConfig, tmp_path: Path, per_address: int
) -> None:
    """Issue 42, finding 3: 1,030 idle connections from one address (no key needed) reset 38 of 40 other
    clients' requests, because the global connection cap was checked before anything else. Now a new connection
    past a cap closes the connection that has waited longest for a request head (of the hoarding address), so
    with the per-address cap, and with the total cap alone (behind a load balancer), every other client's
    request is served while one address keeps opening more idle connections than the proxy allows in all."""
    proxy = StubProxy(
        kafka,
        redis_config,
        tmp_path,
        TURNSTREAM_PROXY_MAX_CONNECTIONS="32",
        TURNSTREAM_PROXY_MAX_CONNECTIONS_PER_ADDRESS=str(per_address),
        TURNSTREAM_PROXY_HEAD_TIMEOUT_S="60",
    )
    host, port = _host_port(proxy.url)
    hoarded: list[asyncio.StreamWriter] = []
    try:
        hoarded += await _hoard(host, port, 40, "127.0.0.2")  # more than the proxy takes in all
        served = await _served(proxy.url, 20)
        hoarded += await _hoard(host, port, 40, "127.0.0.2")  # and again, between requests
        served += await _served(proxy.url, 20)
        assert served == 40
        evicted = scraped(proxy.url, "turnstream_http_connections_refused_total", reason="evicted")
        assert evicted >= 80 - (per_address or 32), evicted
    finally:
        for w in hoarded:
            w.close()
        proxy.close()


async def test_a_head_that_completes_on_a_later_read_counts_whole(
    kafka: KafkaConfig, redis_config: RedisConfig, tmp_path: Path
) -> None:
    """Issue 42, finding 4: a 70 KB head was served, because bytes were counted only while the head was
    incomplete and the read that completed it was not counted. Now every read counts up to the head's end: a head
    sent in pieces whose last piece completes it is a 431 as a whole one is; a head just under the limit followed
    by its body in the same read is served."""
    proxy = StubProxy(kafka, redis_config, tmp_path, TURNSTREAM_PROXY_MAX_HEAD_BYTES="16384")
    host, port = _host_port(proxy.url)
    try:
        body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}).encode()
        for junk, pieces, status in ((20_000, 2, b"431"), (70_000, 3, b"431"), (15_000, 1, b"200")):
            head = (
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\nX-Junk: %s\r\n\r\n" % (len(body), b"a" * junk)
            )
            reader, writer = await asyncio.open_connection(host, port)
            step = len(head) // pieces + 1
            with contextlib.suppress(ConnectionError):  # refused mid-head: the rest goes nowhere
                for i in range(0, len(head), step):
                    writer.write(head[i : i + step] + (body if i + step >= len(head) else b""))
                    await writer.drain()
                    await asyncio.sleep(0.2)  # each piece its own read
            if status == b"431":  # the answer, unless the pieces sent after it reset the connection first
                try:
                    answer = await _closed_by_peer(reader, 5)
                except ConnectionError:
                    answer = b""
                assert answer is not None and (answer == b"" or answer.startswith(b"HTTP/1.1 431")), answer
            else:
                answer = await reader.read(400)
                assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
            writer.close()
        assert scraped(proxy.url, "turnstream_http_connections_refused_total", reason="head_too_large") == 2
        assert_still_serving(proxy.url)
    finally:
        proxy.close()


async def test_connections_past_the_limit_are_refused_and_messages_capped(
    kafka: KafkaConfig, redis_config: RedisConfig, tmp_path: Path
) -> None:
    """Issue 32, item 7: no connection limit, and half a million empty messages parsed on the event loop. Beyond
    ``proxy.max_connections`` connections all busy with a request, a new one is closed at once (counted; idle ones
    would be closed to make room instead: ``test_one_address_hoarding_idle_connections_locks_nobody_out``); more
    than ``proxy.max_messages`` messages is a 400 naming the limit; a large body is parsed off the event loop and
    still answered."""
    proxy = StubProxy(
        kafka,
        redis_config,
        tmp_path,
        TURNSTREAM_PROXY_MAX_CONNECTIONS="8",
        TURNSTREAM_PROXY_MAX_MESSAGES="1000",
        TURNSTREAM_PROXY_MAX_BODY_BYTES=str(8 * 1024 * 1024),
    )
    host, port = _host_port(proxy.url)
    try:
        held = [await asyncio.open_connection(host, port) for _ in range(8)]
        for _, w in held:  # each busy with a request whose body is still coming
            w.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
            await w.drain()
        await asyncio.sleep(0.3)
        reader, writer = await asyncio.open_connection(host, port)
        assert await _closed_by_peer(reader, 3) == b""  # aborted: nothing sent, closed at once
        writer.close()
        for _, w in held:
            w.close()
        await asyncio.sleep(0.5)
        many = {"messages": [{"role": "user", "content": ""}] * 1001, "max_tokens": 1}
        async with httpx.AsyncClient(timeout=30) as client:
            r = await client.post(proxy.url + "/v1/chat/completions", json=many)
            check(r)
            assert r.status_code == 400 and r.json()["error"]["code"] == "too_many_messages", r.text
            assert "limit of 1000" in r.json()["error"]["message"]
            # Over PARSE_IN_THREAD_BYTES: parsed in a thread, answered and recorded like any other turn.
            long = {"messages": [{"role": "user", "content": "w " * 400_000}], "max_tokens": 1}
            r = await client.post(
                proxy.url + "/v1/chat/completions", json=long, headers={"X-Session-Id": "big"}
            )
            assert r.status_code == 200, r.text[:300]
        assert scraped(proxy.url, "turnstream_http_connections_refused_total", reason="connection_limit") >= 1
        assert_still_serving(proxy.url)
        turns = await wait_for_turns(kafka, 2)  # this one and assert_still_serving's
        assert "big" in {t.session_id for t in turns}
    finally:
        proxy.close()


def test_bodies_holding_more_than_a_chat_needs_are_refused_before_they_are_decoded(
    kafka: KafkaConfig, redis_config: RedisConfig, tmp_path: Path
) -> None:
    """Issue 42, finding 2: a side request's ``metadata`` array of empty lists was decoded whole (8 MiB: 170 MB
    of Python objects) and re-encoded for the engine. Now the values a body holds are counted from its bytes
    first (more than ``proxy.max_values`` is a 400), and fields SGLang does not read may hold at most
    ``proxy.max_extra_bytes`` (a 413 naming them); text full of commas is not mistaken for values."""
    proxy = StubProxy(
        kafka,
        redis_config,
        tmp_path,
        TURNSTREAM_PROXY_MAX_VALUES="1000",
        TURNSTREAM_PROXY_MAX_EXTRA_BYTES="4096",
        TURNSTREAM_PROXY_MAX_BODY_BYTES=str(1024 * 1024),
    )
    base = b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1'
    side = {"X-Turn-Type": "side", "content-type": "application/json"}
    try:
        cases = [
            (base + b', "metadata": [' + b"[]," * 5000 + b"[]]}", 400, "too_many_values", "more than 1000"),
            (base + b', "metadata": [' + b'"",' * 5000 + b'""]}', 400, "too_many_values", "more than 1000"),
            (base + b', "tools": [{"a": [' + b"{}," * 5000 + b"{}]}]}", 400, "too_many_values", ""),
            (base + b', "metadata": "' + b"x" * 10_000 + b'"}', 413, "extra_fields_too_large", "'metadata'"),
        ]
        for raw, status, code, needle in cases:
            r = httpx.post(proxy.url + "/v1/chat/completions", content=raw, headers=side, timeout=30)
            check(r)
            assert (r.status_code, r.json()["error"]["code"]) == (status, code), r.text[:300]
            assert needle in r.json()["error"]["message"]
        # A CSV of 100k commas in a message, and small extras, are served.
        csv = ",".join(str(i % 10) for i in range(100_000))
        ok = {
            "messages": [{"role": "user", "content": csv}],
            "max_tokens": 1,
            "metadata": {"trace": "x" * 1000},
        }
        r = httpx.post(
            proxy.url + "/v1/chat/completions", json=ok, headers={"X-Session-Id": "csv"}, timeout=30
        )
        assert r.status_code == 200, r.text[:300]
        assert_still_serving(proxy.url)
    finally:
        proxy.close()


async def test_one_key_cannot_take_more_than_its_share(
    kafka: KafkaConfig, redis_config: RedisConfig, tmp_path: Path
) -> None:
    """Issue 42, finding 2 (and finding 3's keys): a key may have only ``proxy.large_bodies_per_key`` bodies over
    ``proxy.large_body_bytes`` (or of more than 20,000 values, whatever their size), and
    ``proxy.max_requests_per_key`` requests, in flight; one more is a 429 with Retry-After (OpenAI's rate-limit
    shape), before its body is read when its length says it is large, while another key is served, and the slots
    come back when the responses end (streamed or not)."""
    keys = tmp_path / "keys"
    alice, bob = "alice-key-0123456789abcdef", "bob-key-0123456789abcdef"
    keys.write_text(f"alice {alice}\nbob {bob}\n")
    keys.chmod(0o600)
    proxy = StubProxy(
        kafka,
        redis_config,
        tmp_path,
        stub_args=("--latency-ms", "1500"),
        TURNSTREAM_PROXY_KEYS_FILE=str(keys),
        TURNSTREAM_PROXY_LARGE_BODY_BYTES="200000",
        TURNSTREAM_PROXY_LARGE_BODIES_PER_KEY="2",
        TURNSTREAM_PROXY_MAX_REQUESTS_PER_KEY="4",
        TURNSTREAM_PROXY_MAX_BODY_BYTES=str(1024 * 1024),
    )
    proxy.auth = {"Authorization": f"Bearer {alice}"}
    large = {"messages": [{"role": "user", "content": "x" * 300_000}], "max_tokens": 1}
    parts = [{"type": "text", "text": ""}] * 5000  # 25,000 values in 150 KB: large by what it costs to decode
    heavy = {"messages": [{"role": "user", "content": parts}], "max_tokens": 1}
    small = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}

    async def post(http: httpx.AsyncClient, key: str, body: dict[str, Any], stream: bool = False) -> Any:
        headers = {"Authorization": f"Bearer {key}", "X-Turn-Type": "side"}
        r = await http.post(
            proxy.url + "/v1/chat/completions", json={**body, "stream": stream}, headers=headers
        )
        return (
            r.status_code,
            r.headers.get("retry-after"),
            r.json()["error"]["code"] if r.status_code != 200 else "",
        )

    try:
        async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=50)) as http:
            refused = (429, "1", "rate_limit_exceeded")
            for bodies in ([large, large, large], [large, heavy, large]):
                got = await asyncio.gather(
                    *(post(http, alice, b, stream=bool(i % 2)) for i, b in enumerate(bodies)),
                    post(http, bob, large),
                )
                assert sorted(got[:3]) == [(200, None, ""), (200, None, ""), refused], got
                assert got[3] == (200, None, "")
            got = await asyncio.gather(*(post(http, alice, small) for _ in range(5)), post(http, bob, small))
            assert sorted(got[:5]) == [(200, None, "")] * 4 + [(429, "1", "rate_limit_exceeded")], got
            assert got[5] == (200, None, "")
            # Every slot came back: the same again is served the same way.
            got = await asyncio.gather(*(post(http, alice, large) for _ in range(2)))
            assert got == [(200, None, "")] * 2
        limited = "turnstream_proxy_key_limited_total"
        assert scraped(proxy.url, limited, headers=proxy.auth, cap="large_bodies") == 2
        assert scraped(proxy.url, limited, headers=proxy.auth, cap="requests") == 1
    finally:
        proxy.close()


def _modes(folder: Path) -> tuple[int, list[int]]:
    """A folder's permission bits and those of every file in it."""
    return folder.stat().st_mode & 0o777, [f.stat().st_mode & 0o777 for f in folder.iterdir() if f.is_file()]


async def test_a_full_spool_refuses_main_turns_and_loses_none_it_served(
    kafka: KafkaConfig, redis_config: RedisConfig, tmp_path: Path
) -> None:
    """Issue 32, item 6: with Kafka down and a small disk, served turns piled up in memory and a stop lost them.
    The spool has a cap (``proxy.spool_max_bytes``); past it main turns are a 503 ``spool_full`` (side turns are
    served), counted; every turn served before is on disk, 0600 in a 0700 folder, and reaches Kafka after a restart
    with the broker back."""
    dead = f"127.0.0.1:{free_port()}"
    proxy = StubProxy(
        kafka,
        redis_config,
        tmp_path,
        TURNSTREAM_KAFKA_BOOTSTRAP=dead,
        TURNSTREAM_PROXY_SPOOL_MAX_BYTES="60000",
        TURNSTREAM_PROXY_MAX_BODY_BYTES="65536",
    )
    served: list[str] = []
    refused = None
    try:
        async with httpx.AsyncClient(timeout=30) as client:
            for i in range(40):
                body = {"messages": [{"role": "user", "content": f"{i} " + "x" * 10_000}], "max_tokens": 2}
                r = await client.post(
                    proxy.url + "/v1/chat/completions", json=body, headers={"X-Session-Id": f"full-{i}"}
                )
                if r.status_code == 503:
                    refused = r
                    break
                check(r)
                assert r.status_code == 200, r.text[:300]
                served.append(f"full-{i}")
                await asyncio.sleep(0.3)  # the spool's group commit (200 ms) has written it
            assert refused is not None, "40 turns of 10 kB fit a spool of 60 kB"
            assert refused.json()["error"]["code"] == "spool_full" and refused.headers["retry-after"] == "5"
            assert len(served) >= 3
            side = await client.post(
                proxy.url + "/v1/chat/completions",
                json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
                headers={"X-Turn-Type": "side"},
            )
            assert side.status_code == 200
        assert scraped(proxy.url, "turnstream_proxy_turns_refused_total", reason="spool_full") >= 1
        assert scraped(proxy.url, "turnstream_proxy_spool_full") == 1
        folder, files = _modes(Path(proxy.proxy._env["TURNSTREAM_PROXY_SPOOL_DIR"]))
        assert folder == 0o700 and files and set(files) == {0o600}, (oct(folder), files)
        # A stop keeps them (on disk); the proxy started again with the broker back publishes every served turn.
        proxy.proxy.stop()
        port = free_port()
        env = {
            **proxy.proxy._env,
            **kafka.client_env(),
            "TURNSTREAM_PROXY_PORT": str(port),
        }
        with ServiceProcess(
            ["proxy"], port=port, ready_path="/metrics", env=env, startup_timeout_s=60
        ) as again:
            turns = await wait_for_turns(kafka, len(served), timeout=60)
            assert sorted(t.session_id for t in turns) == sorted(served)
            assert_still_serving(again.url)
    finally:
        proxy.proxy.stop()
        proxy.stub.stop()


def test_the_proxy_needs_keys_beyond_loopback_and_each_key_names_a_user(
    kafka: KafkaConfig, redis_config: RedisConfig, tmp_path: Path
) -> None:
    """Issue 32, item 5: authentication was off by default (an empty PROXY_API_KEY too), nothing stopped a proxy
    listening beyond loopback without it, and ``/v1/models`` showed the model's path to anyone. Now the proxy
    refuses to start beyond loopback without keys; keys can be one per user (``proxy.keys_file``); ``/v1/models``
    and ``/metrics`` need a key like the API (``/healthz`` does not)."""
    for key in (None, ""):
        env = {
            **os.environ,
            **kafka.client_env(),
            "TURNSTREAM_LOGGING_FORMAT": "text",
        }
        env.pop("TURNSTREAM_PROXY_API_KEY", None)
        if key is not None:
            env["TURNSTREAM_PROXY_API_KEY"] = key
        out = subprocess.run(
            [sys.executable, "-m", "services.cli", "proxy", "--host", "0.0.0.0", "--port", str(free_port())],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 2 and "proxy.api_key" in out.stderr, (
            key,
            out.returncode,
            out.stderr[-1000:],
        )

    keys = tmp_path / "keys"
    keys.write_text("# user key\nalice alice-key-0123456789abcdef\nbob   bob-key-0123456789abcdef  # bob\n")
    keys.chmod(0o600)
    proxy = StubProxy(kafka, redis_config, tmp_path, TURNSTREAM_PROXY_KEYS_FILE=str(keys))
    try:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        chat = proxy.url + "/v1/chat/completions"
        for auth in (None, "Bearer wrong-key-0123456789abcdef", "Basic alice-key-0123456789abcdef"):
            headers = {"Authorization": auth} if auth else {}
            for method, url in (
                ("POST", chat),
                ("GET", proxy.url + "/v1/models"),
                ("GET", proxy.url + "/metrics"),
            ):
                r = httpx.request(
                    method, url, json=body if method == "POST" else None, headers=headers, timeout=30
                )
                assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (auth, url)
                assert "stub" not in r.text
        # Issue 55, row 4: the probe's answer to anyone, the replicas' addresses and versions only with a key.
        health = httpx.get(proxy.url + "/healthz", timeout=30)
        assert health.status_code == 200 and health.json() == {"status": "ok"}, health.text
        for user in ("alice", "bob"):
            headers = {"Authorization": f"Bearer {user}-key-0123456789abcdef"}
            keyed = httpx.get(proxy.url + "/healthz", headers=headers, timeout=30).json()
            assert keyed["engine"] is True and list(keyed["replicas"]) == [
                proxy.stub.url.removeprefix("http://")
            ]
            assert httpx.post(chat, json=body, headers=headers, timeout=30).status_code == 200
            assert httpx.get(proxy.url + "/v1/models", headers=headers, timeout=30).status_code == 200
            assert httpx.get(proxy.url + "/metrics", headers=headers, timeout=30).status_code == 200
        # Every session lives in its user's namespace: the same id sent with another key is another session, so
        # nobody can add to or end another's session (nor tell whether it exists: issue 42).
        alice = {"Authorization": "Bearer alice-key-0123456789abcdef", "X-Session-Id": "owned"}
        bob = {**alice, "Authorization": "Bearer bob-key-0123456789abcdef"}
        claims = {**body, "user": "mallory"}  # the recorded user is the key's, not what the client writes
        assert httpx.post(chat, json=claims, headers=alice, timeout=30).status_code == 200
        for headers in (bob, {**bob, "X-Turn-Type": "side", "X-Session-Done": "true"}):
            r = httpx.post(chat, json=body, headers=headers, timeout=30)
            assert r.status_code == 200, r.text
        again = httpx.post(chat, json=body, headers=alice, timeout=30)
        assert again.status_code == 200 and again.headers["x-session-id"] == "owned"
        turns = asyncio.run(wait_for_turns(kafka, 5))
        owned = sorted((t.session_id, t.turn_index, t.user) for t in turns if t.session_id.endswith("/owned"))
        assert owned == [("alice/owned", 1, "alice"), ("alice/owned", 2, "alice"), ("bob/owned", 1, "bob")]
    finally:
        proxy.proxy.stop()
        proxy.stub.stop()

"""The proxy end to end: the official openai SDK through the proxy to the real SGLang server; recorded turns
hold exactly what the engine produced: its ids, its raw log-probs (equal to its own prefill scoring) and the
sampling values it used."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import openai
import pytest

from runtime.configuration.config import Config, KafkaConfig, RedisConfig
from schemas.topics import SESSIONS_ENDED
from services.engine.launch import EngineProcess
from tests.kafka_wait import wait_for_events
from tests.metrics import scraped
from tests.services.proxy.conftest import ProxyProcess, assert_still_serving, pair_all, wait_for_turns

pytestmark = pytest.mark.integration

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


def sdk(proxy: ProxyProcess, **kw: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=proxy.url + "/v1", api_key=kw.pop("api_key", "unused"), **kw)


async def rescore(engine: EngineProcess, prompt: list[int], response: list[int]) -> list[float]:
    async with httpx.AsyncClient(timeout=120) as http:
        r = await http.post(
            engine.url + "/generate",
            json={
                "input_ids": prompt + response,
                "sampling_params": {"max_new_tokens": 0},
                "return_logprob": True,
                "logprob_start_len": len(prompt) - 1,
            },
        )
    return [e[0] for e in r.json()["meta_info"]["input_token_logprobs"][1:]]


async def test_non_streaming_turn_records_the_engines_exact_tokens(
    proxy: ProxyProcess, engine: EngineProcess, kafka: KafkaConfig
) -> None:
    client = sdk(proxy, default_headers={"X-Session-Id": "sess-a", "X-Turn-Type": "main"})
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a fruit."}]
    resp = client.chat.completions.create(model="policy", messages=messages, max_tokens=12, temperature=0)
    assert resp.choices[0].message.content
    assert resp.choices[0].logprobs is None, "the client did not ask for log-probs, so it sees none"
    extra = resp.choices[0].model_extra or {}
    assert not {"response_token_ids", "prompt_token_ids", "meta_info"} & extra.keys()

    (turn,) = await wait_for_turns(kafka, 1)
    assert turn.turn_id == "sess-a:1" and turn.session_id == "sess-a" and turn.turn_index == 1
    assert turn.response.content == resp.choices[0].message.content
    assert [m.content for m in turn.messages] == ["Be brief.", "Name a fruit."]
    assert len(turn.response_token_ids) == resp.usage.completion_tokens == len(turn.response_logprobs)
    assert len(turn.prompt_token_ids) == resp.usage.prompt_tokens
    assert turn.token_source == "engine" and turn.weight_version == 0 and turn.sampling.temperature == 0
    # SmolLM2's generation_config sets no sampling values: SGLang's defaults were used, and pinned on the request.
    assert (turn.sampling.top_p, turn.sampling.top_k, turn.sampling.min_p) == (1.0, -1, 0.0)
    # The same request straight to the engine produces the same ids (greedy) ...
    async with httpx.AsyncClient(timeout=120) as http:
        direct = (
            await http.post(
                engine.url + "/v1/chat/completions",
                json={
                    "messages": messages,
                    "max_tokens": 12,
                    "temperature": 0,
                    "logprobs": True,
                    "return_token_ids": True,
                },
            )
        ).json()["choices"][0]
    assert turn.prompt_token_ids == direct["prompt_token_ids"]
    assert turn.response_token_ids == direct["response_token_ids"]
    # ... and the recorded log-probs are the model's for exactly those tokens, position by position.
    scored = await rescore(engine, turn.prompt_token_ids, turn.response_token_ids)
    assert max(abs(a - b) for a, b in zip(scored, turn.response_logprobs, strict=True)) < 1e-4


async def test_streaming_with_tools_records_what_was_streamed(
    proxy: ProxyProcess, engine: EngineProcess, kafka: KafkaConfig
) -> None:
    client = sdk(proxy)
    stream = client.chat.completions.create(
        model="policy",
        messages=[{"role": "user", "content": "What's the weather in Oslo?"}],
        tools=TOOLS,
        max_tokens=24,
        temperature=0.6,
        stream=True,
        logprobs=True,
        extra_headers={"X-Session-Id": "sess-s", "X-Turn-Type": "main"},
        extra_body={"ignore_eos": True},
    )
    text, lps, chunks, arrivals = [], [], 0, []
    for chunk in stream:
        chunks += 1
        for c in chunk.choices:
            if c.delta.content:
                text.append(c.delta.content)
                arrivals.append(time.monotonic())
            if c.logprobs and c.logprobs.content:
                lps.extend(x.logprob for x in c.logprobs.content)
    assert chunks > 10
    # Relayed as the engine produced them (24 tokens at its ~16 tokens/s): a proxy that buffered the stream would
    # hand them over at once.
    assert arrivals[-1] - arrivals[0] > 0.25
    (turn,) = await wait_for_turns(kafka, 1)
    assert turn.session_id == "sess-s" and turn.tools == TOOLS
    assert turn.response.content == "".join(text)
    assert turn.response_logprobs == pytest.approx(lps) and len(turn.response_token_ids) == 24
    # Sampled at temperature 0.6, recorded raw (T = 1): equal to the engine's own prefill scoring of the same ids
    # (SGLANG_RETURN_ORIGINAL_LOGPROB=1; without it they are log_softmax(logits / 0.6) and this fails).
    assert turn.sampling.temperature == 0.6
    scored = await rescore(engine, turn.prompt_token_ids, turn.response_token_ids)
    assert max(abs(a - b) for a, b in zip(scored, turn.response_logprobs, strict=True)) < 1e-4


async def test_a_client_that_leaves_mid_stream_stops_the_engine_and_nothing_is_recorded(
    proxy: ProxyProcess, engine: EngineProcess, kafka: KafkaConfig
) -> None:
    generated = "sglang:generation_tokens_total"
    before = scraped(engine.url, generated)
    body = {
        "messages": [{"role": "user", "content": "Tell me a long story."}],
        "max_tokens": 400,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.stream(
        "POST", proxy.url + "/v1/chat/completions", json=body, headers={"X-Session-Id": "leaver"}, timeout=60
    ) as r:
        events = 0
        for line in r.iter_lines():
            events += line.startswith("data:")
            if events == 3:
                break  # and the client closes its connection mid-stream
    # The proxy closes its engine stream and SGLang aborts the request: its token count stops growing far short
    # of the 400 tokens (~30 s of generation here) it would otherwise make.
    settled, last = time.monotonic() + 20, -1.0
    while time.monotonic() < settled:
        time.sleep(2.0)
        now = scraped(engine.url, generated)
        if now == last:
            break
        last = now
    assert last == scraped(engine.url, generated), "the engine stopped generating"
    assert last - before < 200
    assert scraped(proxy.url, "turnstream_proxy_turns_dropped_total", reason="stream_incomplete") == 1
    assert_still_serving(proxy.url)
    (turn,) = await wait_for_turns(kafka, 1)  # the still-serving check's, under a generated session id
    assert turn.session_id != "leaver"


async def test_a_forced_tool_call_streams_and_records_exact_ids(
    proxy: ProxyProcess, engine: EngineProcess, kafka: KafkaConfig
) -> None:
    """SGLang constrains the output to a call of the named tool: the streamed call and its ids are recorded, and
    since SGLang's log-probs of a constrained token are taken after the grammar's mask, the proxy re-scores them
    (the raw model's, as the trainer computes them: counted)."""
    stream = sdk(proxy).chat.completions.create(
        model="policy",
        messages=[{"role": "user", "content": "What's the weather in Oslo?"}],
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=40,
        temperature=0.6,
        stream=True,
        extra_headers={"X-Session-Id": "sess-tool"},
    )
    names, arguments = [], []
    for chunk in stream:
        for c in chunk.choices:
            for tc in c.delta.tool_calls or ():
                if tc.function and tc.function.name:
                    names.append(tc.function.name)
                if tc.function and tc.function.arguments:
                    arguments.append(tc.function.arguments)
    assert names == ["get_weather"]
    (turn,) = await wait_for_turns(kafka, 1)
    assert turn.response.tool_calls is not None and len(turn.response.tool_calls) == 1
    call = turn.response.tool_calls[0].function
    assert (call.name, call.arguments) == ("get_weather", "".join(arguments))
    assert turn.sampling.temperature == 0.6
    scored = await rescore(engine, turn.prompt_token_ids, turn.response_token_ids)
    assert max(abs(a - b) for a, b in zip(scored, turn.response_logprobs, strict=True)) < 1e-4
    assert scraped(proxy.url, "turnstream_proxy_turns_rescored_total", reason="tool_choice") == 1


async def test_side_turns_are_not_recorded_and_session_done_is(
    proxy: ProxyProcess, kafka: KafkaConfig
) -> None:
    client = sdk(proxy)
    msgs = [{"role": "user", "content": "hi"}]
    client.chat.completions.create(
        model="p",
        messages=msgs,
        max_tokens=3,
        extra_headers={"X-Session-Id": "s-side", "X-Turn-Type": "side"},
    )
    # The same fields in the body work too (and never reach the engine, which would reject them).
    client.chat.completions.create(
        model="p",
        messages=msgs,
        max_tokens=3,
        extra_body={"session_id": "s-done", "turn_type": "main", "session_done": True},
    )
    # Two main turns, then the client ends the session on a side request (X-Session-Done, as OpenClaw's clients
    # do): the end names the last main turn, which the pairer then closes.
    for _ in range(2):
        client.chat.completions.create(
            model="p", messages=msgs, max_tokens=3, extra_headers={"X-Session-Id": "s-ends"}
        )
    client.chat.completions.create(
        model="p",
        messages=msgs,
        max_tokens=3,
        extra_headers={"X-Session-Id": "s-ends", "X-Turn-Type": "side", "X-Session-Done": "true"},
    )
    turns = await wait_for_turns(kafka, 3)
    ends = await wait_for_events(kafka, SESSIONS_ENDED, lambda e: len(e) >= 1)
    await asyncio.sleep(1.0)
    turns = await wait_for_turns(kafka, 3)
    assert sorted(t.turn_id for t in turns) == ["s-done:1", "s-ends:1", "s-ends:2"]
    assert [t.session_done for t in turns if t.session_id == "s-done"] == [True]
    assert [(e.session_id, e.after_turn_index) for e in ends] == [("s-ends", 2)]
    assert scraped(proxy.url, "turnstream_proxy_sessions_ended_total") == 1


async def test_missing_session_id_gets_a_generated_one(proxy: ProxyProcess, kafka: KafkaConfig) -> None:
    t0 = time.perf_counter()
    resp = httpx.post(
        proxy.url + "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 2},
        timeout=60,
    )
    elapsed_ms = 1000 * (time.perf_counter() - t0)
    assert resp.status_code == 200
    # The engine's share of the request, as the proxy measured it: a real span, inside the client's.
    name, _, dur = resp.headers["server-timing"].partition(";dur=")
    assert name == "engine" and 0 < float(dur) < elapsed_ms
    sid = resp.headers["x-session-id"]
    assert sid.startswith("anon-")
    (turn,) = await wait_for_turns(kafka, 1)
    assert turn.session_id == sid


async def test_two_replicas_number_one_session_consecutively(
    proxy: ProxyProcess, proxy_env: dict[str, str], kafka: KafkaConfig
) -> None:
    other = ProxyProcess(proxy_env)
    try:
        history: list[dict[str, Any]] = []
        for i, replica in enumerate([proxy, other, proxy]):
            history.append({"role": "user", "content": f"message {i}"})
            resp = httpx.post(
                replica.url + "/v1/chat/completions",
                headers={"X-Session-Id": "shared"},
                json={"messages": history, "max_tokens": 4, "temperature": 0},
                timeout=60,
            )
            assert resp.status_code == 200
            history.append(resp.json()["choices"][0]["message"])
    finally:
        other.stop()
    turns = await wait_for_turns(kafka, 3)
    assert sorted(t.turn_id for t in turns) == ["shared:1", "shared:2", "shared:3"]
    by_index = {t.turn_index: t for t in turns}
    assert [len(by_index[i].messages) for i in (1, 2, 3)] == [1, 3, 5]
    # The pairer follows the session across replicas: each turn's next state is the following user message.
    config = Config(
        kafka=kafka,
        redis=RedisConfig(
            url=proxy_env["TURNSTREAM_REDIS_URL"], key_prefix=proxy_env["TURNSTREAM_REDIS_KEY_PREFIX"]
        ),
    )
    pairs = {p.turn_id: p for p in await pair_all(config, expect=2) if p.next_state is not None}
    assert [m.content for m in pairs["shared:1"].next_state] == ["message 1"]
    assert [m.content for m in pairs["shared:2"].next_state] == ["message 2"]
    assert not pairs["shared:1"].misaligned and not pairs["shared:2"].misaligned


def test_bearer_auth(proxy_env: dict[str, str]) -> None:
    secured = ProxyProcess({**proxy_env, "TURNSTREAM_PROXY_API_KEY": "sk-right"})
    try:
        body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
        for headers in ({}, {"Authorization": "Bearer sk-wrong"}, {"Authorization": "Basic sk-right"}):
            r = httpx.post(secured.url + "/v1/chat/completions", json=body, headers=headers, timeout=60)
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        ok = sdk(secured, api_key="sk-right").chat.completions.create(
            model="p", messages=body["messages"], max_tokens=1
        )
        assert ok.choices[0].message is not None
    finally:
        secured.stop()


BAD: list[tuple[bytes, int, str]] = [
    (b"{oops", 400, "not valid JSON"),
    (b"[1, 2]", 400, "JSON object"),
    (b'{"model": "x"}', 400, "messages"),
    (b'{"messages": []}', 400, "messages"),
    (b'{"messages": "hi"}', 400, "messages"),
    (b'{"messages": [{"content": "no role"}]}', 400, "role"),
    (b'{"messages": [{"role": "user", "content": "x"}], "stream": "yes"}', 400, "stream"),
    (b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', 400, "JSON"),
    (b'{"messages": [{"role": "user", "content": "x"}], "n": 3}', 400, "n"),
]


@pytest.mark.parametrize(("raw", "status", "needle"), BAD)
def test_bad_input_gets_openai_errors_and_the_proxy_keeps_serving(
    proxy: ProxyProcess, raw: bytes, status: int, needle: str
) -> None:
    r = httpx.post(
        proxy.url + "/v1/chat/completions",
        content=raw,
        headers={"content-type": "application/json"},
        timeout=60,
    )
    assert r.status_code == status, r.text
    assert needle in r.json()["error"]["message"]
    assert_still_serving(proxy.url)


def test_huge_bodies_are_413(proxy_env: dict[str, str]) -> None:
    small = ProxyProcess({**proxy_env, "TURNSTREAM_PROXY_MAX_BODY_BYTES": "4096"})
    try:
        big = {"messages": [{"role": "user", "content": "x" * 10_000}]}
        r = httpx.post(small.url + "/v1/chat/completions", json=big, timeout=60)
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

        def chunks():  # no Content-Length: the limit holds for chunked bodies too
            yield b'{"messages": [{"role": "user", "content": "'
            for _ in range(10):
                yield b"y" * 1000
            yield b'"}]}'

        r = httpx.post(small.url + "/v1/chat/completions", content=chunks(), timeout=60)
        assert r.status_code == 413
    finally:
        small.stop()


async def test_engine_failure_is_502_and_records_nothing(
    proxy_env: dict[str, str], kafka: KafkaConfig
) -> None:
    from runtime.process.ports import free_port

    dead = ProxyProcess(
        {
            **proxy_env,
            "TURNSTREAM_ENGINE_URL": f"http://127.0.0.1:{free_port()}",
            "TURNSTREAM_ENGINE_RETRIES": "0",
        }
    )
    try:
        body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
        r = httpx.post(
            dead.url + "/v1/chat/completions", json=body, headers={"X-Session-Id": "dead"}, timeout=60
        )
        assert r.status_code == 502 and r.json()["error"]["type"] == "engine_error"
        r = httpx.post(dead.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=60)
        assert r.status_code == 502
        assert httpx.get(dead.url + "/healthz", timeout=10).status_code == 503
    finally:
        dead.stop()
    assert await wait_for_turns(kafka, 1, timeout=2) == []


async def test_engine_timeout_is_504(proxy_env: dict[str, str], kafka: KafkaConfig) -> None:
    slow = ProxyProcess({**proxy_env, "TURNSTREAM_ENGINE_TIMEOUT_S": "0.3"})
    try:
        body = {
            "messages": [{"role": "user", "content": "Tell a story."}],
            "max_tokens": 200,
            "ignore_eos": True,
        }
        r = httpx.post(slow.url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 504 and r.json()["error"]["type"] == "engine_timeout"
    finally:
        slow.stop()
    assert await wait_for_turns(kafka, 1, timeout=2) == []


def test_healthz_and_models(proxy: ProxyProcess) -> None:
    h = httpx.get(proxy.url + "/healthz", timeout=10).json()
    assert h["status"] == "ok" and h["engine"] is True
    models = sdk(proxy).models.list()
    assert models.data and models.data[0].id
    assert "turnstream_proxy_requests_total" in httpx.get(proxy.url + "/metrics", timeout=10).text

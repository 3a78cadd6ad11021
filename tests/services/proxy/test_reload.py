"""The reloader on the real SGLang server: a published version reaches the engine while a long stream is in
flight (pause with retract, load, continue: the stream completes, nothing is refused, and the load does not wait
for the stream to end); the next turn carries the version and the new weights' log-probs; a version is loaded
once; paths outside the weights root are refused; after an engine restart the newest version is applied again and
every turn is labelled with the weights that produced it; a version under held-out evaluation stays served until
its hold ends."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis

from runtime.configuration.config import KafkaConfig, RedisConfig
from runtime.messaging.bus import EventProducer, read_topic
from schemas import Turn, WeightsPublished
from schemas.topics import DEADLETTER, WEIGHTS
from services.engine.launch import EngineProcess
from tests.engines import admin
from tests.metrics import scraped
from tests.services.proxy.conftest import ProxyProcess, wait_for_turns

pytestmark = pytest.mark.integration

BODY = {
    "messages": [{"role": "user", "content": "Describe the sea in one sentence."}],
    "max_tokens": 12,
    "temperature": 0,
}


async def publish(kafka: KafkaConfig, version: int, path: str) -> None:
    async with EventProducer(kafka) as producer:
        event = WeightsPublished(
            version=version, path=path, base_model="smollm2", step=version, created_at=time.time()
        )
        await producer.send(WEIGHTS, event, "policy")


async def engine_version(http: httpx.AsyncClient, url: str) -> str:
    return str((await http.get(url + "/model_info")).json()["weight_version"])


async def stream_chat(
    http: httpx.AsyncClient, url: str, body: dict[str, Any], session: str, first: asyncio.Event | None = None
) -> list[dict[str, Any]]:
    chunks: list[dict[str, Any]] = []
    async with http.stream(
        "POST", url + "/v1/chat/completions", json={**body, "stream": True}, headers={"X-Session-Id": session}
    ) as resp:
        assert resp.status_code == 200
        async for line in resp.aiter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[6:]))
                if first is not None and len(chunks) >= 3:
                    first.set()
    return chunks


async def test_a_version_loads_during_a_stream_once_and_labels_every_turn(
    own_engine: EngineProcess, proxy_env: dict[str, str], kafka: KafkaConfig, perturbed_weights: Path
) -> None:
    proxy = ProxyProcess(
        {
            **proxy_env,
            "TURNSTREAM_ENGINE_URL": own_engine.url,
            "TURNSTREAM_PROXY_WEIGHTS_ROOT": str(perturbed_weights.parent),
        }
    )
    try:
        async with httpx.AsyncClient(timeout=300) as http:
            headers = {"X-Session-Id": "reload"}
            first = await http.post(proxy.url + "/v1/chat/completions", json=BODY, headers=headers)
            assert first.status_code == 200
            # A long stream is generating when the version is published.
            streaming = asyncio.Event()
            long_body = {**BODY, "max_tokens": 200, "ignore_eos": True}
            long = asyncio.create_task(stream_chat(http, proxy.url, long_body, "long", streaming))
            await asyncio.wait_for(streaming.wait(), 120)
            await publish(kafka, 1, str(perturbed_weights))
            statuses: list[int] = []
            deadline = time.monotonic() + 120
            while await engine_version(http, own_engine.url) != "1":
                assert time.monotonic() < deadline, "the engine never loaded version 1"
                r = await http.post(
                    proxy.url + "/v1/chat/completions", headers={"X-Session-Id": "during"}, json=BODY
                )
                statuses.append(r.status_code)
            assert not long.done(), "the load did not wait for the in-flight stream to finish"
            chunks = await long
            assert statuses and set(statuses) == {200}, "no request failed during the reload"
            assert chunks[-1]["choices"][0]["finish_reason"] == "length", "the paused stream completed"
            second = await http.post(proxy.url + "/v1/chat/completions", json=BODY, headers=headers)
            assert second.status_code == 200

            # The same version again (another trainer replica, a replay) is not loaded twice; a path outside the
            # weights root is refused and dead-lettered.
            await publish(kafka, 1, str(perturbed_weights))
            await publish(kafka, 2, "/etc")
            deadline = time.monotonic() + 60
            while not [r async for r in read_topic(kafka, DEADLETTER)]:
                assert time.monotonic() < deadline, "the refused version was not dead-lettered"
                await asyncio.sleep(0.3)
            assert await engine_version(http, own_engine.url) == "1"
            assert scraped(proxy.url, "turnstream_proxy_weight_reloads_total", status="ok") == 1
    finally:
        proxy.stop()

    turns = {t.turn_id: t for t in await wait_for_turns(kafka, 3 + len(statuses))}
    before, after = turns["reload:1"], turns["reload:2"]
    assert before.weight_version == 0 and after.weight_version == 1
    assert before.prompt_token_ids == after.prompt_token_ids
    n = min(len(before.response_logprobs), len(after.response_logprobs))
    assert before.response_logprobs[:n] != after.response_logprobs[:n], "new weights, new log-probs"
    # Begun on version 0 and finished on version 1: labelled with the older.
    assert turns["long:1"].weight_version == 0 and len(turns["long:1"].response_token_ids) == 200
    letters = [r.event async for r in read_topic(kafka, DEADLETTER)]
    assert any("outside" in d.error for d in letters)


def greedy_answer(model: Any, eos: int, prompt: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
    """A model's greedy answer and its log-probs, from transformers (SGLang's agree to 1e-4: test_logprobs)."""
    import torch

    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False)[0]
        ids = out[len(prompt) :].tolist()
        if eos in ids:
            ids = ids[: ids.index(eos) + 1]
        logits = model(torch.tensor([prompt + ids])).logits[0].float()
    lps = torch.log_softmax(logits, dim=-1)
    return ids, [lps[len(prompt) - 1 + i, t].item() for i, t in enumerate(ids)]


def close(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and a == pytest.approx(b, abs=1e-3)


async def test_after_an_engine_restart_the_newest_version_is_applied_again_and_labels_stay_true(
    own_engine: EngineProcess,
    hf_model: Any,
    proxy_env: dict[str, str],
    kafka: KafkaConfig,
    perturbed_weights: Path,
) -> None:
    """Runs after the test above: the module's engine serves version 1. It is restarted (base weights, version
    0); the proxy notices on a probe and has the reloader apply version 1 again. Turns served meanwhile, streamed
    ones included (their chunks carry no version), are labelled with the weights that produced them."""
    await publish(kafka, 1, str(perturbed_weights))
    proxy = ProxyProcess(
        {
            **proxy_env,
            "TURNSTREAM_ENGINE_URL": own_engine.url,
            "TURNSTREAM_PROXY_WEIGHTS_ROOT": str(perturbed_weights.parent),
            "TURNSTREAM_PROXY_VERSION_PROBE_S": "5",
        }
    )
    try:
        async with httpx.AsyncClient(timeout=300) as http:
            deadline = time.monotonic() + 120
            while await engine_version(http, own_engine.url) != "1":
                assert time.monotonic() < deadline
                await asyncio.sleep(0.5)
            await stream_chat(http, proxy.url, BODY, "before-restart")
            own_engine.restart()  # same port, starting weights
            served = 0
            deadline = time.monotonic() + 120
            while True:  # streamed turns, one after another, until version 1 is back, and one more
                await stream_chat(http, proxy.url, BODY, f"after-{served}")
                served += 1
                if await engine_version(http, own_engine.url) == "1":
                    break
                assert time.monotonic() < deadline, "version 1 was never applied again"
            await stream_chat(http, proxy.url, BODY, f"after-{served}")
            served += 1
    finally:
        proxy.stop()
    turns = {t.turn_id: t for t in await wait_for_turns(kafka, 1 + served)}
    import torch
    from transformers import AutoModelForCausalLM

    base, tok = hf_model
    perturbed = AutoModelForCausalLM.from_pretrained(perturbed_weights, dtype=torch.float32).eval()
    models = {0: base, 1: perturbed}
    ref1 = turns["before-restart:1"]
    prompt, max_tokens = ref1.prompt_token_ids, BODY["max_tokens"]
    reference = {v: greedy_answer(m, tok.eos_token_id, prompt, max_tokens) for v, m in models.items()}
    assert ref1.weight_version == 1
    assert ref1.response_token_ids == reference[1][0] and close(ref1.response_logprobs, reference[1][1])
    assert reference[0][0] != reference[1][0] or not close(reference[0][1], reference[1][1])

    def made_by(turn: Turn) -> int:
        """0 or 1 for a turn made by one version; 0 for one begun on the starting weights and finished on
        version 1 (a reload paused it mid-stream, retracted it and re-prefilled it with the new weights: its
        first tokens are version 0's, the rest version 1's greedy continuation of them)."""
        ids, lps = turn.response_token_ids, turn.response_logprobs
        for version, (want_ids, want_lps) in reference.items():
            if ids == want_ids and close(lps, want_lps):
                return version
        ids0, lps0 = reference[0]
        diverge = (
            i
            for i, (a, b) in enumerate(zip(ids, ids0, strict=False))
            if a != b or not close([lps[i]], [lps0[i]])
        )
        k = next(diverge, min(len(ids), len(ids0)))
        rest = greedy_answer(perturbed, tok.eos_token_id, prompt + ids[:k], max_tokens - k)
        assert k > 0 and ids[k:] == rest[0] and close(lps[k:], rest[1]), (
            f"{turn.turn_id} matches neither the starting weights nor version 1 nor a switch from one to the"
            f" other after {k} tokens: {ids} {lps}, references {reference}"
        )
        return 0

    labels = [turns[f"after-{i}:1"].weight_version for i in range(served)]
    assert labels == [made_by(turns[f"after-{i}:1"]) for i in range(served)], "every label is the truth"
    assert labels[-1] == 1


async def test_a_version_under_evaluation_stays_served_until_its_hold_ends(
    own_engine: EngineProcess,
    proxy_env: dict[str, str],
    kafka: KafkaConfig,
    redis_config: RedisConfig,
    perturbed_weights: Path,
) -> None:
    """``turnstream eval`` holds reloads while it evaluates the served version (a Redis key with an expiry): a
    newer version published meanwhile waits, and loads once the key is deleted."""
    env = {
        **proxy_env,
        "TURNSTREAM_ENGINE_URL": own_engine.url,
        "TURNSTREAM_PROXY_WEIGHTS_ROOT": str(perturbed_weights.parent),
    }
    async with httpx.AsyncClient(timeout=300) as http:
        serving = int(await engine_version(http, own_engine.url) or 0)
        key = redis_config.eval_hold_key(serving)
        store = aioredis.from_url(redis_config.url)
        try:
            await store.set(key, b"1", px=120_000)
            await publish(kafka, serving + 1, str(perturbed_weights))
            proxy = ProxyProcess(env)
            try:
                deadline = time.monotonic() + 60  # the reloader reads the version (from the topic's start)
                while scraped(proxy.url, "turnstream_proxy_reload_held_total") < 1:
                    assert time.monotonic() < deadline, "the reloader never saw the version and its hold"
                    await asyncio.sleep(0.2)
                assert await engine_version(http, own_engine.url) == str(serving), "loaded despite the hold"
                assert scraped(proxy.url, "turnstream_proxy_reload_held_total") == 1
                assert scraped(proxy.url, "turnstream_proxy_weight_reloads_total", status="ok") == 0
                await store.delete(key)
                deadline = time.monotonic() + 60
                while await engine_version(http, own_engine.url) != str(serving + 1):
                    assert time.monotonic() < deadline, "the version never loaded after the hold ended"
                    await asyncio.sleep(0.5)
                assert scraped(proxy.url, "turnstream_proxy_weight_reloads_total", status="ok") == 1
            finally:
                proxy.stop()
        finally:
            await store.delete(key)
            await store.aclose()


async def test_two_proxies_reload_one_engine_one_at_a_time(
    own_engine: EngineProcess, proxy_env: dict[str, str], kafka: KafkaConfig, perturbed_weights: Path
) -> None:
    """Two proxies in front of one engine (Kubernetes runs two) both follow ``weights``. SGLang 0.5.23 crashes its
    tokenizer manager when two loads overlap on a paused engine, so each version must be loaded by one of them
    while the other waits for the engine's lease: every version served, each loaded once, the engine still
    answering through both."""
    env = {
        **proxy_env,
        "TURNSTREAM_ENGINE_URL": own_engine.url,
        "TURNSTREAM_PROXY_WEIGHTS_ROOT": str(perturbed_weights.parent),
    }
    proxies = [ProxyProcess(env), ProxyProcess(env)]
    try:
        async with httpx.AsyncClient(timeout=300) as http:
            serving = int(await engine_version(http, own_engine.url) or 0)
            await asyncio.sleep(6)  # both followers are at the topic's end: each version reaches both at once
            versions = [serving + 1, serving + 2, serving + 3]
            for version in versions:
                await publish(kafka, version, str(perturbed_weights))
                deadline = time.monotonic() + 120
                while await engine_version(http, own_engine.url) != str(version):
                    assert time.monotonic() < deadline, f"the engine never served version {version}"
                    await asyncio.sleep(0.3)
            for p in proxies:
                r = await http.post(
                    p.url + "/v1/chat/completions", json=BODY, headers={"X-Session-Id": "two"}
                )
                assert r.status_code == 200, r.text
            health = await http.get(own_engine.url + "/health", timeout=60)
            assert health.status_code == 200, "the engine stopped answering"
            loads = sum(scraped(p.url, "turnstream_proxy_weight_reloads_total", status="ok") for p in proxies)
            assert loads == len(versions), f"{loads} loads for {len(versions)} versions"
    finally:
        for p in proxies:
            p.stop()


async def test_an_engine_a_dead_reloader_left_paused_serves_again_within_two_lease_periods(
    own_engine: EngineProcess, proxy_env: dict[str, str], redis_config: RedisConfig
) -> None:
    """Issue 55, row 7: a proxy killed between pausing its engine and continuing it (at any step: after the pause,
    during or after the load, the engine is left paused) left it paused until another proxy started. Here another
    proxy's reloader paused the engine and died holding the engine's lease; this proxy, already running, continues
    the engine once that lease has expired: within two lease periods (2 s here), while a user waits."""
    env = {**proxy_env, "TURNSTREAM_ENGINE_URL": own_engine.url, "TURNSTREAM_PROXY_RELOAD_LEASE_S": "2"}
    proxy = ProxyProcess(env)
    r = aioredis.from_url(redis_config.url)
    try:
        async with httpx.AsyncClient(timeout=120) as http:
            await asyncio.sleep(4)  # past its start-up continue: only its watch can end the pause below
            await r.set(redis_config.reload_lease_key(own_engine.url), "a-reloader-killed-mid-load", px=2000)
            paused = await http.post(
                own_engine.url + "/pause_generation", json={"mode": "retract"}, headers=admin(own_engine)
            )
            assert paused.status_code == 200, paused.text
            began = time.monotonic()
            answer = await http.post(
                proxy.url + "/v1/chat/completions",
                json=BODY,
                headers={"X-Session-Id": "left-paused"},
                timeout=90,
            )
            waited = time.monotonic() - began
            assert answer.status_code == 200, answer.text
            # Two periods and the answer's own time (seconds on a loaded CPU), never the 90 s of a pause that stays.
            assert waited < 30, f"the user waited {waited:.1f} s"
    finally:
        proxy.stop()
        await r.aclose()
        httpx.post(own_engine.url + "/continue_generation", headers=admin(own_engine), timeout=60)

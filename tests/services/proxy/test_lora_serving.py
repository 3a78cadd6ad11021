"""LoRA versions on the real SGLang (CPU, ``--lora-backend torch_native``): the trainer's published adapter is
loaded beside the base model, the policy's turns go to it and carry its version, its log-probs are the trainer's,
the adapter before is unloaded once nothing uses it, requests naming no adapter (the judge's, the teacher's) get
the base model, and a full-weights version sent to an adapter-serving proxy is dead-lettered. Under the gate's
``adapter`` mechanism, over two replicas, a candidate is loaded beside the promoted version on each and evaluated
by name while users are answered by the promoted one, until the gate promotes it."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from runtime.configuration.config import KafkaConfig, LoraConfig, TrainerConfig
from runtime.engine.client import EngineClient, adapter_name
from runtime.messaging.bus import EventProducer, read_topic
from runtime.pipeline.personas import by_name
from schemas import VersionDecision, WeightsPublished
from schemas.topics import DEADLETTER, VERSIONS, WEIGHTS
from services.engine.launch import EngineProcess
from services.eval.worker import Evaluator
from services.trainer.checkpoints import TrainerStore
from tests.engines import ENGINE_KEYS, LORA_ENV
from tests.metrics import scraped
from tests.samples import random_rl_samples
from tests.services.proxy.conftest import ProxyProcess, routing_key, spread_sessions, wait_for_turns

pytestmark = pytest.mark.integration

API_KEY = ENGINE_KEYS["TURNSTREAM_ENGINE_API_KEY"]
ENGINE_AUTH = {"Authorization": f"Bearer {API_KEY}"}
BODY = {
    "messages": [{"role": "user", "content": "Name three colours."}],
    "max_tokens": 10,
    "temperature": 0,
}


@pytest.fixture(scope="module")
def trained(smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Two adapter versions as the trainer publishes them (a step each, a large learning rate so that greedy
    answers change), and the policy to compare log-probs with."""
    from services.trainer.policy import Policy

    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("weights")
    config = TrainerConfig(
        lr=2e-2, precision="fp32", lora=LoraConfig(enabled=True), hf_checkpoint=str(smollm2_path)
    )
    policy = Policy.from_hf(smollm2_path, config)
    store = TrainerStore(root)
    paths = {}
    for version in (1, 2):
        policy.train(random_rl_samples(2, seed=5, low=100, high=5000, prompt=12, response=8))
        paths[version], _ = store.write_version(
            version, policy.entries(), policy.hf_stream(), smollm2_path, policy.version_files()
        )
        if version == 1:
            first = {k: v.clone() for k, v in policy.module.state_dict().items() if ".lora." in k}
    return {"policy": policy, "paths": paths, "root": root, "v1": first}


def trainer_logprobs(
    policy: Any, state: dict[str, torch.Tensor], prompt: list[int], response: list[int]
) -> list[float]:
    """The policy's log-prob of each response token, with the adapter ``state`` in place."""
    from services.trainer.lora import load_adapter_state
    from services.trainer.step import token_logprobs

    load_adapter_state(policy.module, state)
    tokens = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = policy.logits(policy.model, tokens, torch.ones_like(tokens))[..., : policy.spec.vocab_size]
    return token_logprobs(logits.float(), tokens)[0, len(prompt) - 1 :].tolist()


async def publish(kafka: KafkaConfig, version: int, path: Path, fmt: str = "peft-lora") -> None:
    async with EventProducer(kafka) as producer:
        event = WeightsPublished(
            version=version,
            path=str(path),
            base_model="smollm2",
            step=version,
            created_at=time.time(),
            format=fmt,
        )
        await producer.send(WEIGHTS, event, "policy")


async def adapters(http: httpx.AsyncClient, url: str) -> set[str]:
    data = (await http.get(url + "/v1/models", headers=ENGINE_AUTH)).json()["data"]
    return {m["id"] for m in data if m.get("parent")}


async def until(check: Any, what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not await check():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.3)


async def test_adapter_versions_are_served_labelled_and_retired(
    lora_engine: EngineProcess, proxy_env: dict[str, str], kafka: KafkaConfig, trained: dict[str, Any]
) -> None:
    paths = trained["paths"]
    proxy = ProxyProcess(
        {
            **proxy_env,
            **LORA_ENV,
            **ENGINE_KEYS,
            "TURNSTREAM_ENGINE_URL": lora_engine.url,
            "TURNSTREAM_PROXY_WEIGHTS_ROOT": str(trained["root"]),
        }
    )
    try:
        async with httpx.AsyncClient(timeout=300) as http:
            # The engine's admin routes only with the admin key (issue 32, item 3), which the proxy's reloader
            # sends for the loads below (that nothing passes without the API key where the engine has one:
            # tests/services/run/test_run.py, whose engines check both keys).
            for auth in ({}, ENGINE_AUTH):
                hijack = {"lora_name": "mine", "lora_path": str(trained["paths"][1])}
                r = await http.post(lora_engine.url + "/load_lora_adapter", json=hijack, headers=auth)
                assert r.status_code == 401, r.text
            assert (await http.get(lora_engine.url + "/health")).status_code == 200  # probes need no key
            chat = proxy.url + "/v1/chat/completions"
            base = await http.post(chat, json=BODY, headers={"X-Session-Id": "a"})
            assert base.status_code == 200, base.text
            await publish(kafka, 1, paths[1])
            await until(lambda: _has(http, lora_engine.url, {adapter_name(1)}), "version 1 was never loaded")
            one = await http.post(chat, json=BODY, headers={"X-Session-Id": "a"})
            assert one.status_code == 200
            assert one.json()["choices"][0]["message"] != base.json()["choices"][0]["message"]
            # The client sees the policy's version, not the base weights' that SGLang reports.
            assert (
                one.json()["metadata"]["weight_version"] == "1"
                and base.json()["metadata"]["weight_version"] == "0"
            )
            assert {s["version"] for s in one.json()["metadata"]["weight_versions"]} == {"1"}
            side = await http.post(chat, json=BODY, headers={"X-Session-Id": "side", "X-Turn-Type": "side"})
            assert side.json()["metadata"]["weight_version"] == "1"
            streamed = await http.post(chat, json={**BODY, "stream": True}, headers={"X-Session-Id": "s"})
            assert streamed.status_code == 200 and "[DONE]" in streamed.text
            # The judge's and the teacher's requests name no adapter: the base model answers them.
            direct = await http.post(lora_engine.url + "/v1/chat/completions", json=BODY, headers=ENGINE_AUTH)
            assert direct.json()["choices"][0]["message"] == base.json()["choices"][0]["message"]

            await publish(kafka, 2, paths[2])
            await until(
                lambda: _has(http, lora_engine.url, {adapter_name(2)}), "version 1 was not retired for 2"
            )
            two = await http.post(chat, json=BODY, headers={"X-Session-Id": "a"})
            assert two.status_code == 200
            # A client naming an adapter in "model" (SGLang's "<base>:<adapter>") still gets the policy's: SGLang
            # would reload the retired version 1 from its path on demand.
            named = await http.post(
                chat, json={**BODY, "model": f"x:{adapter_name(1)}"}, headers={"X-Session-Id": "a"}
            )
            assert named.json()["choices"][0]["message"] == two.json()["choices"][0]["message"]
            # turnstream eval evaluates the newest adapter, asking it by name: its answers are the adapter's.
            evaluator = Evaluator(
                EngineClient(lora_engine.url, api_key=API_KEY),
                by_name(None),
                ["Name three colours."],
                10,
                1,
                True,
            )
            served = await evaluator.served()
            assert served is not None and served[0] == 2
            evaluated = await evaluator.evaluate(*served)
            assert evaluated is not None
            assert evaluated.answers[0].answer == two.json()["choices"][0]["message"]["content"].strip()
            # Full weights sent to a proxy that serves adapters: refused, named, nothing loaded.
            await publish(kafka, 3, paths[2], fmt="hf-safetensors")
            await until(lambda: _letters(kafka), "the full-weights version was not dead-lettered", 60)
            assert await adapters(http, lora_engine.url) == {adapter_name(2)}
            assert scraped(proxy.url, "turnstream_proxy_weight_reloads_total", status="ok") == 2
            assert scraped(proxy.url, "turnstream_proxy_adapters_unloaded_total", status="ok") == 1
    finally:
        proxy.stop()

    turns = {t.turn_id: t for t in await wait_for_turns(kafka, 5)}
    assert [turns[f"a:{i}"].weight_version for i in (1, 2, 3, 4)] == [0, 1, 2, 2]
    assert turns["s:1"].weight_version == 1
    letters = [r.event async for r in read_topic(kafka, DEADLETTER)]
    assert any("serves LoRA adapters" in d.error for d in letters)
    # The engine's log-probs under adapter 1 are the trainer's for the same tokens.
    t = turns["a:2"]
    want = trainer_logprobs(trained["policy"], trained["v1"], t.prompt_token_ids, t.response_token_ids)
    assert max(abs(a - b) for a, b in zip(t.response_logprobs, want, strict=True)) < 1e-3


async def test_under_the_adapter_gate_a_candidate_is_evaluated_beside_and_never_served(
    lora_engine: EngineProcess,
    second_engine: EngineProcess,
    proxy_env: dict[str, str],
    kafka: KafkaConfig,
    trained: dict[str, Any],
) -> None:
    """Over two replicas: the candidate is loaded beside the promoted version on each, the evaluation asks it by
    name on whichever answers, no user on either replica gets it, and the verdict reaches both."""
    urls = [lora_engine.url, second_engine.url]
    env = {
        **proxy_env,
        **LORA_ENV,
        **ENGINE_KEYS,
        "TURNSTREAM_ENGINE_REPLICAS": ",".join(urls),
        "TURNSTREAM_PROXY_WEIGHTS_ROOT": str(trained["root"]),
        "TURNSTREAM_GATE_ENABLED": "true",
        "TURNSTREAM_GATE_MECHANISM": "adapter",
    }
    proxy = ProxyProcess(env)
    chat = proxy.url + "/v1/chat/completions"
    replicas = [f"127.0.0.1:{e.port}" for e in (lora_engine, second_engine)]
    secret = routing_key(env)  # the engine keys make the routing hash keyed: the test's spread must use it
    sessions = spread_sessions("g", replicas, 3, secret)

    async def decide(state: str, by: str = "gate") -> None:
        async with EventProducer(kafka) as producer:
            event = VersionDecision(version=1, state=state, reason="test", by=by, decided_at=time.time())
            await producer.send(VERSIONS, event, "policy")

    async def ask(session: str) -> dict[str, Any]:
        r = await http.post(chat, json=BODY, headers={"X-Session-Id": session})
        assert r.status_code == 200, r.text
        return dict(r.json())

    async def on_every_replica(names: set[str]) -> bool:
        return all([await _has(http, url, names) for url in urls])

    # The first replica is down for the evaluation (a port nothing listens on): it asks the second.
    evaluator = Evaluator(
        [EngineClient(url, api_key=API_KEY, retries=0) for url in ("http://127.0.0.1:9", *urls[1:])],
        by_name(None),
        ["Name three colours."],
        10,
        1,
        True,
    )
    try:
        async with httpx.AsyncClient(timeout=300) as http:
            base = await ask(sessions[0])
            assert base["metadata"]["weight_version"] == "0"
            await publish(kafka, 1, trained["paths"][1])
            # Loaded beside the base on each replica (an adapter left by another test retired): the only one there.
            await until(lambda: on_every_replica({adapter_name(1)}), "the candidate was not loaded beside")
            await decide("candidate")
            # The evaluation asks the candidate by name and gets its answers; users still get the promoted one's.
            served = await evaluator.served()
            assert served is not None and served[0] == 1 and evaluator.engine.base_url == urls[1]
            evaluated = await evaluator.evaluate(*served)
            assert evaluated is not None
            assert evaluated.answers[0].answer != base["choices"][0]["message"]["content"].strip()
            for session in sessions:
                during = await ask(session)
                assert during["metadata"]["weight_version"] == "0"
                assert during["choices"][0]["message"] == base["choices"][0]["message"]
            await decide("rejected")
            await until(lambda: on_every_replica(set()), "the rejected candidate stayed loaded")
            assert (await ask(sessions[0]))["metadata"]["weight_version"] == "0"
            await decide("promoted", by="manual")  # turnstream versions promote 1: now users get it
            await until(lambda: on_every_replica({adapter_name(1)}), "the promoted version was not loaded")
            deadline = time.monotonic() + 120
            while (promoted := await ask("h"))["metadata"]["weight_version"] != "1":
                assert time.monotonic() < deadline, "the version promoted by hand was never served"
                await asyncio.sleep(0.5)
            assert promoted["choices"][0]["message"]["content"].strip() == evaluated.answers[0].answer
            for session in spread_sessions("after-", replicas, 3, secret):
                after = await ask(session)
                assert after["metadata"]["weight_version"] == "1", after
    finally:
        proxy.stop()
    turns = await wait_for_turns(kafka, 3 + 3 * len(sessions))
    during_turns = [t for t in turns if t.session_id in sessions]
    assert {t.weight_version for t in during_turns} == {0}
    assert {t.replica for t in during_turns} == set(replicas), (
        "users on both replicas, none given the candidate"
    )
    promoted_turns = [t for t in turns if t.session_id.startswith("after-")]
    assert {t.weight_version for t in promoted_turns} == {1}
    assert {t.replica for t in promoted_turns} == set(replicas)


async def _has(http: httpx.AsyncClient, url: str, names: set[str]) -> bool:
    return await adapters(http, url) == names


async def _letters(kafka: KafkaConfig) -> bool:
    return bool([r async for r in read_topic(kafka, DEADLETTER)])

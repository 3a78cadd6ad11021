"""The reloader end to end: a published weight version reaches the engine; the next turn carries it and the new
weights' log-probs; no request failed meanwhile; paths outside the weights root are refused."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from schemas import WeightsPublished
from schemas.topics import DEADLETTER, WEIGHTS
from services.bus import EventProducer, read_topic
from services.config import KafkaConfig
from services.engine.launch import EngineProcess
from tests.services.proxy.conftest import ProxyProcess, wait_for_turns

pytestmark = pytest.mark.integration

BODY = {
    "messages": [{"role": "user", "content": "Describe the sea in one sentence."}],
    "max_tokens": 12,
    "temperature": 0,
}


@pytest.fixture
def own_engine(smollm2_path: Path) -> Iterator[EngineProcess]:
    proc = EngineProcess(smollm2_path)
    yield proc
    proc.stop()


async def test_published_weights_reach_the_engine_and_the_next_turn(
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
        async with httpx.AsyncClient(timeout=120) as http:
            headers = {"X-Session-Id": "reload"}
            assert (
                await http.post(proxy.url + "/v1/chat/completions", json=BODY, headers=headers)
            ).status_code == 200
            statuses: list[int] = []
            async with EventProducer(kafka) as producer:
                await producer.send(
                    WEIGHTS,
                    WeightsPublished(
                        version=1,
                        path=str(perturbed_weights),
                        base_model="smollm2",
                        step=1,
                        created_at=time.time(),
                    ),
                    "policy",
                )
            deadline = time.monotonic() + 120
            while (await http.get(own_engine.url + "/get_model_info")).json()["weight_version"] != "1":
                assert time.monotonic() < deadline, "the engine never loaded version 1"
                r = await http.post(
                    proxy.url + "/v1/chat/completions",
                    headers={"X-Session-Id": "during"},
                    json={**BODY, "max_tokens": 2},
                )
                statuses.append(r.status_code)
            assert statuses and set(statuses) == {200}, "no request failed during the reload"
            assert (
                await http.post(proxy.url + "/v1/chat/completions", json=BODY, headers=headers)
            ).status_code == 200

            # A version whose path is outside the weights root is refused and dead-lettered.
            async with EventProducer(kafka) as producer:
                await producer.send(
                    WEIGHTS,
                    WeightsPublished(
                        version=2, path="/etc", base_model="smollm2", step=2, created_at=time.time()
                    ),
                    "policy",
                )
            deadline = time.monotonic() + 60
            while not [r async for r in read_topic(kafka, DEADLETTER)]:
                assert time.monotonic() < deadline, "the refused version was not dead-lettered"
                await asyncio.sleep(0.3)
            assert (await http.get(own_engine.url + "/get_model_info")).json()["weight_version"] == "1"
    finally:
        proxy.stop()

    turns = {t.turn_id: t for t in await wait_for_turns(kafka, 2 + len(statuses))}
    before, after = turns["reload:1"], turns["reload:2"]
    assert before.weight_version == 0 and after.weight_version == 1
    assert before.prompt_token_ids == after.prompt_token_ids
    n = min(len(before.response_logprobs), len(after.response_logprobs))
    assert before.response_logprobs[:n] != after.response_logprobs[:n], "new weights, new log-probs"
    letters = [r.event async for r in read_topic(kafka, DEADLETTER)]
    assert any("outside" in d.error for d in letters)

"""Under a gate the reloader serves what ``versions`` decides: which version that is (``gated_target``), and on the
real SGLang server a full-weights candidate served once the gate tries it (serve-then-check), rolled back to the
starting weights when the gate says so, and promoted again by hand from the path its candidate decision
recorded."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import pytest

from runtime.configuration.config import KafkaConfig
from runtime.messaging.bus import EventProducer
from runtime.pipeline.promotion import fold
from schemas import VersionDecision
from schemas.topics import VERSIONS
from services.engine.launch import EngineProcess
from services.proxy.reloader import Target, gated_target
from tests.services.proxy.conftest import ProxyProcess, wait_for_turns
from tests.services.proxy.test_reload import BODY, engine_version, publish


def decided(version: int, state: str, by: str = "gate", path: str = "") -> VersionDecision:
    return VersionDecision(
        version=version, state=state, reason="test", by=by, decided_at=time.time(), path=path
    )


@pytest.mark.parametrize(
    ("history", "newest", "mechanism", "target"),
    [
        ([], None, "adapter", Target(0, None)),
        ([], 1, "adapter", Target(0, 1)),  # not yet a candidate: loaded beside already
        ([], 1, "serve-then-check", Target(0, None)),  # not tried yet: the gate says when
        ([(1, "candidate")], 1, "serve-then-check", Target(1, None)),  # served while checked
        ([(1, "candidate")], 2, "serve-then-check", Target(1, None)),  # a newer one waits its turn
        ([(1, "candidate")], 1, "adapter", Target(0, 1)),
        ([(1, "promoted")], 1, "adapter", Target(1, None)),
        ([(1, "rejected")], 1, "adapter", Target(0, None)),
        ([(1, "rolled_back")], 1, "serve-then-check", Target(0, None)),
        ([(1, "promoted"), (2, "candidate")], 2, "serve-then-check", Target(2, None)),
        ([(1, "promoted"), (2, "superseded")], 3, "adapter", Target(1, 3)),
        ([(1, "promoted"), (1, "pinned")], 2, "serve-then-check", Target(1, None)),  # a pin wins
        ([(1, "promoted"), (1, "pinned")], 2, "adapter", Target(1, 2)),  # still evaluated beside
        ([(3, "promoted"), (3, "rolled_back")], 3, "adapter", Target(0, None)),
    ],
)
def test_the_target_follows_the_decisions(
    history: list[tuple[int, str]], newest: int | None, mechanism: str, target: Target
) -> None:
    assert gated_target(fold(decided(v, s) for v, s in history), newest, mechanism) == target


@pytest.mark.integration
async def test_serve_then_check_serves_a_candidate_and_rolls_it_back(
    own_engine: EngineProcess, proxy_env: dict[str, str], kafka: KafkaConfig, perturbed_weights: Path
) -> None:
    proxy = ProxyProcess(
        {
            **proxy_env,
            "TURNSTREAM_ENGINE_URL": own_engine.url,
            "TURNSTREAM_PROXY_WEIGHTS_ROOT": str(perturbed_weights.parent),
            "TURNSTREAM_GATE_ENABLED": "true",
            "TURNSTREAM_GATE_MECHANISM": "serve-then-check",
        }
    )

    async def reaches(version: str) -> None:
        deadline = time.monotonic() + 180
        while await engine_version(http, own_engine.url) != version:
            assert time.monotonic() < deadline, f"the engine never served version {version}"
            await asyncio.sleep(0.5)

    try:
        async with httpx.AsyncClient(timeout=300) as http:
            before = await http.post(
                proxy.url + "/v1/chat/completions", json=BODY, headers={"X-Session-Id": "a"}
            )
            assert before.status_code == 200
            await publish(kafka, 1, str(perturbed_weights))
            await asyncio.sleep(3)
            assert await engine_version(http, own_engine.url) == "0"  # published, not yet tried by the gate
            async with EventProducer(kafka) as producer:
                await producer.send(VERSIONS, decided(1, "candidate", path=str(perturbed_weights)), "policy")
            await reaches("1")  # served once a candidate: it is checked while served
            async with EventProducer(kafka) as producer:
                await producer.send(VERSIONS, decided(1, "rolled_back"), "policy")
            await reaches("0")  # the engine's own starting weights again
            after = await http.post(
                proxy.url + "/v1/chat/completions", json=BODY, headers={"X-Session-Id": "b"}
            )
            assert after.status_code == 200
            async with EventProducer(kafka) as producer:
                await producer.send(VERSIONS, decided(1, "promoted", by="manual"), "policy")
            await reaches("1")
    finally:
        proxy.stop()
    turns = {t.turn_id: t for t in await wait_for_turns(kafka, 2)}
    first, again = turns["a:1"], turns["b:1"]
    assert first.weight_version == 0 and again.weight_version == 0
    assert first.response_token_ids == again.response_token_ids  # the starting weights, not version 1's
    assert first.response_logprobs == pytest.approx(again.response_logprobs, abs=1e-4)

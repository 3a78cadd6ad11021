"""Two real SGLang policy replicas behind one proxy: a session's turns stay on one replica and each turn records
the replica that answered; a replica killed in the middle of traffic costs only the streams it was generating (a
clean error in-band, nothing recorded for them), new requests go to the survivor at once, every answered turn is
recorded exactly once, and the replica, started again on its starting weights after a version was published, takes
no traffic until it has loaded the served version, then rejoins (one restart: each costs a minute or two).
Under the gate (serve-then-check) the real eval and gate services decide a candidate that both replicas serve while
it is checked, the eval asking whichever replica answers, and both follow the verdict."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from runtime.configuration.config import (
    Config,
    EngineConfig,
    EvalConfig,
    GateConfig,
    KafkaConfig,
    RedisConfig,
)
from runtime.messaging.bus import EventProducer, read_topic
from runtime.process.ports import free_port
from schemas import VersionDecision
from schemas.topics import EVALS, VERSIONS
from services.engine.launch import EngineProcess
from services.eval.worker import run_eval
from services.gate.worker import run_gate
from tests.engines import admin
from tests.metrics import scraped
from tests.services.proxy.conftest import ProxyProcess, routing_key, spread_sessions, wait_for_turns
from tests.services.proxy.test_reload import engine_version, publish

pytestmark = pytest.mark.integration


@pytest.fixture
def replicas_proxy(
    own_engine: EngineProcess,
    second_engine: EngineProcess,
    proxy_env: dict[str, str],
    perturbed_weights: Path,
) -> Iterator[ProxyProcess]:
    proxy = ProxyProcess(
        {
            **proxy_env,
            "TURNSTREAM_ENGINE_REPLICAS": f"{own_engine.url},{second_engine.url}",
            "TURNSTREAM_PROXY_WEIGHTS_ROOT": str(perturbed_weights.parent),
            "TURNSTREAM_PROXY_VERSION_PROBE_S": "0.5",
        }
    )
    yield proxy
    proxy.stop()


def name(engine: EngineProcess) -> str:
    return f"127.0.0.1:{engine.port}"


def body(session: str, max_tokens: int = 8, stream: bool = False) -> dict[str, Any]:
    return {
        "messages": [{"role": "user", "content": f"Say something about {session}."}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
    }


async def ask(http: httpx.AsyncClient, url: str, session: str, **kw: Any) -> bool:
    """One turn of ``session``; True when it was answered whole (a stream that ended with [DONE])."""
    request = body(session, **kw)
    headers = {"X-Session-Id": session}
    if not request["stream"]:
        resp = await http.post(url + "/v1/chat/completions", json=request, headers=headers)
        assert resp.status_code in (200, 502), resp.text
        return resp.status_code == 200
    async with http.stream("POST", url + "/v1/chat/completions", json=request, headers=headers) as resp:
        assert resp.status_code == 200
        lines = [line async for line in resp.aiter_lines() if line.startswith("data: ")]
    if lines[-1] == "data: [DONE]":
        return True
    error = json.loads(lines[-1][6:])["error"]  # broken off: the client is told in-band
    assert "mid-stream" in error["message"]
    return False


def unaccounted(url: str, proxy: ProxyProcess, whole: Counter[str], turns: list[Any]) -> str:
    """Which sessions' answered turns are not on ``turns`` (or are there twice), with the proxy's own account of
    turns it did not record and the warnings it logged: what a shortfall needs to be traced."""
    recorded = Counter(t.session_id for t in turns)
    off = {s: (whole[s], recorded[s]) for s in whole.keys() | recorded.keys() if whole[s] != recorded[s]}
    counters = {
        name: scraped(url, name)
        for name in (
            "turnstream_proxy_turns_dropped_total",
            "turnstream_proxy_turns_recorded_total",
            "turnstream_proxy_turns_published_total",
            "turnstream_proxy_spool_pending",
            "turnstream_proxy_publish_failures_total",
            "turnstream_proxy_version_probes_total",
        )
    }
    proxy.logfile.flush()
    log = Path(proxy.logfile.name).read_text().splitlines()
    warnings = [line for line in log if "warn" in line.lower() or "error" in line.lower()][-30:]
    return json.dumps({"answered_vs_recorded": off, "counters": counters, "log": warnings}, indent=1)


@pytest.mark.timeout(600)  # the replica's restart alone takes one to two minutes of the two cores
async def test_sessions_stay_put_a_killed_replica_loses_nothing_and_rejoins_on_the_served_version(
    replicas_proxy: ProxyProcess,
    own_engine: EngineProcess,
    second_engine: EngineProcess,
    kafka: KafkaConfig,
    perturbed_weights: Path,
    proxy_env: dict[str, str],
) -> None:
    """Sessions stay on their replica; the second is killed while it streams (those streams break off in-band,
    everything else is answered by the survivor at once); a version is published while it is dead, and it is
    started again on its starting weights while turns keep coming: it takes none until its reloader has loaded
    the served version onto it, then new sessions reach it. Every answered turn is recorded once."""
    url = replicas_proxy.url
    both = [name(own_engine), name(second_engine)]
    sessions = spread_sessions("s", both, 4, routing_key(proxy_env))
    answered = 0
    whole: Counter[str] = Counter()  # turns answered whole, by session: what a shortfall is looked up against

    async def turn(session: str, **kw: Any) -> bool:
        ok = await ask(http, url, session, **kw)
        whole[session] += ok
        return ok

    async with httpx.AsyncClient(timeout=300) as http:
        for n in range(2):
            for session in sessions:
                answered += await turn(session, stream=n == 1)
        turns = await wait_for_turns(kafka, answered)
        assert len(turns) == answered, unaccounted(url, replicas_proxy, whole, turns)
        homes = defaultdict(set)
        for t in turns:
            homes[t.session_id].add(t.replica)
        assert all(len(h) == 1 for h in homes.values()), homes  # each session on one replica
        used = Counter(next(iter(h)) for h in homes.values())
        assert set(used) == set(both), used  # both take sessions
        on_second = [s for s in sessions if homes[s] == {name(second_engine)}]

        # Long streams on the second replica; it is killed while they generate.
        streams = [asyncio.create_task(turn(s, max_tokens=400, stream=True)) for s in on_second]
        await asyncio.sleep(3.0)
        os.killpg(second_engine.proc.pid, signal.SIGKILL)
        during = [asyncio.create_task(turn(s)) for s in sessions]  # while it is down: all answered
        done = await asyncio.gather(*streams)
        assert await asyncio.gather(*during) == [True] * len(sessions)
        answered += sum(done) + len(sessions)
        assert not all(done)  # those it was generating broke off (one may have finished before the kill)

        # A version published while it is dead reaches the survivor; the dead one is started again on its starting
        # weights (version 0) while turns keep coming: every one is answered by version 1, the restarted replica
        # taking none until its reloader has loaded version 1 onto it.
        await publish(kafka, 1, str(perturbed_weights))
        deadline = time.monotonic() + 180
        while await engine_version(http, own_engine.url) != "1":
            assert time.monotonic() < deadline
            await asyncio.sleep(0.2)
        loads = scraped(url, "turnstream_proxy_weight_reloads_total", status="ok")
        restart = asyncio.create_task(asyncio.to_thread(second_engine.restart))  # back on the same port
        deadline = time.monotonic() + 300
        i = 0
        while not restart.done() or not (
            await engine_version(http, second_engine.url) == "1"
            and scraped(url, "turnstream_proxy_replica_ready", replica=name(second_engine)) == 1
        ):
            answered += await turn(f"during-{i}", stream=i % 2 == 1)
            i += 1
            assert time.monotonic() < deadline
        await restart
        assert scraped(url, "turnstream_proxy_weight_reloads_total", status="ok") > loads  # given version 1
        fresh = spread_sessions("new", both, 4, routing_key(proxy_env))
        for session in fresh:
            answered += await turn(session)
        await asyncio.sleep(2.0)  # anything recorded twice would be in by now
        turns = await wait_for_turns(kafka, answered)
    ids = Counter(t.turn_id for t in turns)
    assert len(turns) == answered and max(ids.values()) == 1, unaccounted(
        url, replicas_proxy, whole, turns
    )  # each answered turn once, none of the broken ones
    assert scraped(url, "turnstream_proxy_turns_dropped_total", reason="stream_incomplete") == len(
        done
    ) - sum(done)
    later = [t for t in turns if t.session_id.startswith(("during-", "new"))]
    assert i > 0 and {t.weight_version for t in later} == {1}, Counter(
        (t.replica, t.weight_version) for t in later
    )
    rejoined = {t.replica for t in turns if t.session_id in fresh}
    assert name(second_engine) in rejoined  # new sessions reach it again
    account = {"answered": answered, "recorded": len(turns), "broken_streams": len(done) - sum(done)}
    print(json.dumps({**account, "failovers": scraped(url, "turnstream_proxy_failovers_total")}))


async def test_under_the_gate_both_replicas_serve_the_candidate_the_eval_checks_and_follow_the_verdict(
    own_engine: EngineProcess,
    second_engine: EngineProcess,
    proxy_env: dict[str, str],
    kafka: KafkaConfig,
    redis_config: RedisConfig,
    perturbed_weights: Path,
    smollm2_path: Path,
) -> None:
    engines = (own_engine, second_engine)
    for engine in engines:  # their starting weights (version 0), whatever the test before left on them
        back = httpx.post(
            engine.url + "/update_weights_from_disk",
            json={"model_path": str(smollm2_path), "weight_version": "0"},
            headers=admin(engine),
            timeout=600,
        )
        assert back.status_code == 200, back.text
    proxy = ProxyProcess(
        {
            **proxy_env,
            "TURNSTREAM_ENGINE_REPLICAS": f"{own_engine.url},{second_engine.url}",
            "TURNSTREAM_PROXY_WEIGHTS_ROOT": str(perturbed_weights.parent),
            "TURNSTREAM_PROXY_VERSION_PROBE_S": "0.5",
            "TURNSTREAM_GATE_ENABLED": "true",
            "TURNSTREAM_GATE_MECHANISM": "serve-then-check",
        }
    )
    gate = GateConfig(enabled=True, mechanism="serve-then-check", margin=1.0, poll_s=0.2)
    # The eval is given a replica that never answers first: it evaluates on the ones that do.
    dead = f"http://127.0.0.1:{free_port()}"
    config = Config(
        kafka=kafka,
        redis=redis_config,
        engine=EngineConfig(replicas=[dead, own_engine.url, second_engine.url], retries=0),
        eval=EvalConfig(poll_s=0.5, max_tokens=16),
        gate=gate,
    )
    stop = asyncio.Event()
    services = [
        asyncio.create_task(run_eval(config, install_signals=False, stop=stop)),
        asyncio.create_task(run_gate(config, install_signals=False, stop=stop)),
    ]

    async def states() -> list[tuple[int, str]]:
        return [(r.event.version, r.event.state) async for r in read_topic(kafka, VERSIONS)]

    async def evaluated() -> list[int]:
        return [r.event.version async for r in read_topic(kafka, EVALS)]

    async def both_serve(version: str) -> None:
        deadline = time.monotonic() + 240
        while [await engine_version(http, e.url) for e in engines] != [version, version]:
            assert time.monotonic() < deadline, f"not every replica served version {version}"
            await asyncio.sleep(0.3)

    try:
        async with httpx.AsyncClient(timeout=300) as http:
            deadline = time.monotonic() + 240
            while 0 not in await evaluated():  # the promoted version's result, the candidate's baseline
                assert time.monotonic() < deadline and not any(t.done() for t in services)
                await asyncio.sleep(0.5)
            await publish(kafka, 1, str(perturbed_weights))
            await both_serve("1")  # a candidate: served on every replica while it is checked
            assert (1, "candidate") in await states()
            deadline = time.monotonic() + 300
            while (1, "promoted") not in await states():
                assert time.monotonic() < deadline, await states()
                await asyncio.sleep(0.5)
            assert 1 in await evaluated()
            gated = spread_sessions("gated-", [name(e) for e in engines], 3, routing_key(proxy_env))
            answered = [await ask(http, proxy.url, session) for session in gated]
            async with EventProducer(kafka) as producer:  # then rolled back (by hand): both go back
                event = VersionDecision(
                    version=1, state="rolled_back", reason="test", by="manual", decided_at=time.time()
                )
                await producer.send(VERSIONS, event, "policy")
            await both_serve("0")
    finally:
        stop.set()
        await asyncio.wait_for(asyncio.gather(*services), 120)
        proxy.stop()
    assert all(answered)
    turns = [t for t in await wait_for_turns(kafka, 6) if t.session_id.startswith("gated-")]
    assert {t.weight_version for t in turns} == {1}
    assert {t.replica for t in turns} == {name(own_engine), name(second_engine)}
    results = [r.event async for r in read_topic(kafka, EVALS)]
    assert sorted({r.version for r in results}) == [0, 1] and len(results) == 2, "each version evaluated once"

"""What the proxy adds, measured side by side against going straight to the engine, in one run. Prints JSON.

    .venv/bin/python bench/proxy.py [--requests 600] [--latency-ms 20] [--tokens 60]
    .venv/bin/python bench/proxy.py --engine sglang [--engine-url URL] [--requests 64] [--max-tokens 8]

The proxy runs as ``turnstream proxy`` with Kafka publishing on (Kafka and Redis from scripts/ unless
TURNSTREAM_KAFKA_BOOTSTRAP / TURNSTREAM_REDIS_URL are set). At the end every recorded turn must have reached
Kafka.

``--engine stub`` (the default): a stub engine (bench/stub_engine.py, its own process) answers after a fixed
latency with a fixed number of tokens and their log-probs. For concurrency 1, 16 and 64: latency p50/p99 and
requests/s direct vs through the proxy; time to first streamed chunk; the proxy's own CPU time per 1,000 requests
(from /proc).

``--engine sglang``: the real SGLang 0.5.23 server (started here with ``EngineProcess``, SmolLM2-135M-Instruct,
70-100 s of start-up on the CPU, its log in a temporary file; or the one at ``--engine-url``). For concurrency 1
and 8, non-streamed and streamed, the same greedy request (short prompt, ``max_tokens`` 8, ``temperature`` 0,
``ignore_eos``, every sampling value the proxy would pin given explicitly) goes straight to SGLang, through a bare
TCP relay (bench/tcp_relay.py: the cheapest extra process on the path) and through the proxy, in rounds of C
requests at once whose order rotates every round, so that the drift of a noisy machine falls on every side alike.
The direct and relayed requests ask SGLang for the ids and log-probs the proxy asks for on its own account
(``EXACT_NON_STREAMED`` / ``EXACT_STREAMED``), so the engine does the same work every way. Per cell: latency p50
of each side and what the proxy adds to direct (also the median over rounds of the round medians' difference,
less sensitive to drift), what the relay adds, the proxy against the relay, and for non-streamed requests the
proxy's own time (the client's latency less the engine time in the proxy's ``Server-Timing`` header); time to the
first streamed chunk with content; requests/s ratio; the proxy's CPU seconds per 1,000 requests (during its own
rounds; during the others, where it only idles and publishes, as ms per second); the goals: added p50 <= 2 ms,
first streamed chunk within 5 ms of direct. Why 8 tokens: the engine's run-to-run variance grows with the
tokens it decodes, while the proxy's work on a non-streamed answer does not (a streamed one costs it about 0.2 ms
of CPU per event, not measurable in the latency even at 128 tokens); at 32 tokens on this machine the relay,
which by construction adds nothing, measured anywhere from -8 to +32 ms, more than the goal. ``--max-tokens 32``
or 128 shows the same picture with wider noise (bench/RESULTS.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx
from infra import Started, start_kafka, start_redis, stop_started

from runtime.configuration.config import KafkaConfig
from runtime.engine.client import EXACT_NON_STREAMED, EXACT_STREAMED
from runtime.messaging.bus import read_topic
from runtime.messaging.topics import create_topics
from runtime.process.ports import free_port
from services.engine.launch import SGLANG_VERSION, EngineProcess
from services.proxy.sampling import OPENAI_SAMPLING

REPO = Path(__file__).resolve().parent.parent
BODY = {"model": "stub", "messages": [{"role": "user", "content": "Tell me something."}], "max_tokens": 60}
TICKS = os.sysconf("SC_CLK_TCK")
SGLANG_PROMPT = "Tell me something about lighthouses."


def cpu_seconds(pid: int) -> float:
    return sum(cpu_split(pid))


def cpu_split(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of a process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) / TICKS, int(fields[12]) / TICKS


def wait_http(url: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            httpx.get(url, timeout=1)
            return
        except httpx.HTTPError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


async def load(
    url: str, concurrency: int, total: int, stream: bool, headers_for: object, body: dict[str, Any] = BODY
) -> dict[str, float]:
    latencies: list[float] = []
    firsts: list[float] = []
    counter = iter(range(total))
    # One client (one connection) per worker: httpx's shared pool collapses past a few dozen concurrent requests
    # and would measure the load generator instead of what it loads.
    clients = [httpx.AsyncClient(timeout=60) for _ in range(concurrency)]
    try:

        async def worker(w: int) -> None:
            http = clients[w]
            for i in counter:
                headers = headers_for(w, i)  # type: ignore[operator]
                t0 = time.perf_counter()
                if stream:
                    async with http.stream("POST", url, json={**body, "stream": True}, headers=headers) as r:
                        assert r.status_code == 200
                        first = None
                        async for line in r.aiter_lines():
                            if first is None and line.startswith("data:"):
                                first = time.perf_counter() - t0
                    firsts.append(first or 0.0)
                else:
                    r = await http.post(url, json=body, headers=headers)
                    assert r.status_code == 200, r.text
                latencies.append(time.perf_counter() - t0)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker(w) for w in range(concurrency)))
        wall = time.perf_counter() - t0
    finally:
        for c in clients:
            await c.aclose()
    lat = sorted(latencies)
    out = {
        "p50_ms": 1000 * lat[len(lat) // 2],
        "p99_ms": 1000 * lat[min(len(lat) - 1, int(len(lat) * 0.99))],
        "rps": len(lat) / wall,
    }
    if firsts:
        out["first_chunk_p50_ms"] = 1000 * statistics.median(firsts)
    return out


def start_proxy(
    engine_url: str, bootstrap: str, redis_url: str, namespace: str, extra: dict[str, str] | None = None
) -> tuple[subprocess.Popen[bytes], int]:
    """``turnstream proxy`` in front of ``engine_url``, recording into ``namespace`` (``extra``: more settings);
    its process and port."""
    proxy_port = free_port()
    tmp = tempfile.mkdtemp(prefix="turnstream-bench-")
    env = {
        **os.environ,
        "TURNSTREAM_KAFKA_BOOTSTRAP": bootstrap,
        "TURNSTREAM_KAFKA_NAMESPACE": namespace,
        "TURNSTREAM_REDIS_URL": redis_url,
        "TURNSTREAM_REDIS_KEY_PREFIX": namespace,
        "TURNSTREAM_ENGINE_URL": engine_url,
        "TURNSTREAM_PROXY_PORT": str(proxy_port),
        "TURNSTREAM_PROXY_SPOOL_DIR": tmp + "/spool",
        "TURNSTREAM_PROXY_WEIGHTS_ROOT": tmp,
        "TURNSTREAM_LOGGING_LEVEL": "WARNING",
        **(extra or {}),
    }
    proxy = subprocess.Popen([sys.executable, "-m", "services.cli", "proxy"], env=env, cwd=REPO)
    return proxy, proxy_port


def published_turns(proxy_port: int, kafka: KafkaConfig) -> int:
    """The turns on the namespace's topic once the proxy's spool has drained (or after 120 s)."""
    deadline = time.monotonic() + 120
    while True:
        pending = httpx.get(f"http://127.0.0.1:{proxy_port}/healthz", timeout=5).json()["spool_pending"]
        if pending == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.5)

    async def count() -> int:
        from schemas.topics import TURNS

        n = 0
        async for _ in read_topic(kafka, TURNS):
            n += 1
        return n

    return asyncio.run(count())


def bench_kafka(started: Started) -> tuple[str, str, str, KafkaConfig]:
    """Kafka and Redis (see infra.py), a fresh namespace with its topics: bootstrap, Redis URL, namespace."""
    bootstrap, redis_url = start_kafka(started), start_redis(started)
    namespace = f"bench-{uuid.uuid4().hex[:8]}."
    kafka = KafkaConfig(bootstrap=bootstrap, namespace=namespace)
    asyncio.run(create_topics(kafka, partitions=3))
    return bootstrap, redis_url, namespace, kafka


def run_stub(args: argparse.Namespace) -> None:
    requests = args.requests if args.requests is not None else 600
    started: Started = []
    bootstrap, redis_url, namespace, kafka = bench_kafka(started)
    stub_port = free_port()
    stub = subprocess.Popen(
        [
            sys.executable,
            str(REPO / "bench/stub_engine.py"),
            "--port",
            str(stub_port),
            "--latency-ms",
            str(args.latency_ms),
            "--tokens",
            str(args.tokens),
        ]
    )
    proxy, proxy_port = start_proxy(f"http://127.0.0.1:{stub_port}", bootstrap, redis_url, namespace)
    direct_url = f"http://127.0.0.1:{stub_port}/v1/chat/completions"
    proxy_url = f"http://127.0.0.1:{proxy_port}/v1/chat/completions"
    results: dict[str, object] = {}
    sent_main = 0
    try:
        wait_http(f"http://127.0.0.1:{stub_port}/health")
        wait_http(f"http://127.0.0.1:{proxy_port}/metrics")

        def session(w: int, i: int) -> dict[str, str]:
            return {"X-Session-Id": f"bench-{w}-{i}"}

        asyncio.run(
            load(proxy_url, 4, 100, False, session)
        )  # warm-up (connections, imports, JIT-free caches)
        sent_main += 100
        levels = {}
        for c in [int(x) for x in (args.levels or "1,16,64").split(",")]:
            n = max(requests // (4 if c == 1 else 1), 2 * c)
            direct = asyncio.run(load(direct_url, c, n, False, session))
            user0, sys0 = cpu_split(proxy.pid)
            via = asyncio.run(load(proxy_url, c, n, False, session))
            user1, sys1 = cpu_split(proxy.pid)
            cpu = user1 - user0 + sys1 - sys0
            sent_main += n
            levels[str(c)] = {
                "direct": {k: round(v, 2) for k, v in direct.items()},
                "proxy": {k: round(v, 2) for k, v in via.items()},
                "added_p50_ms": round(via["p50_ms"] - direct["p50_ms"], 2),
                "added_p99_ms": round(via["p99_ms"] - direct["p99_ms"], 2),
                "throughput_ratio": round(via["rps"] / direct["rps"], 3),
                "proxy_cpu_s_per_1000": round(1000 * cpu / n, 3),
                "proxy_system_cpu_share": round((sys1 - sys0) / cpu, 2) if cpu else 0.0,
            }
        results["non_streaming"] = levels
        n = max(requests // 4, 50)
        direct = asyncio.run(load(direct_url, 1, n, True, session))
        cpu0 = cpu_seconds(proxy.pid)
        via = asyncio.run(load(proxy_url, 1, n, True, session))
        cpu = cpu_seconds(proxy.pid) - cpu0
        sent_main += n
        results["streaming_c1"] = {
            "direct_first_chunk_p50_ms": round(direct["first_chunk_p50_ms"], 2),
            "proxy_first_chunk_p50_ms": round(via["first_chunk_p50_ms"], 2),
            "added_first_chunk_ms": round(via["first_chunk_p50_ms"] - direct["first_chunk_p50_ms"], 2),
            "added_p50_ms": round(via["p50_ms"] - direct["p50_ms"], 2),
            "proxy_cpu_s_per_1000": round(1000 * cpu / n, 3),
        }
        # Kafka publishing was really on: every turn reaches the topic.
        results["turns_published"] = published_turns(proxy_port, kafka)
        results["turns_expected"] = sent_main
    finally:
        proxy.terminate()
        proxy.wait(30)
        stub.terminate()
        stop_started(started)
    levels = results["non_streaming"]  # type: ignore[assignment]
    goals: dict[str, bool] = {
        "proxy_cpu_s_per_1000<=1.5": max(v["proxy_cpu_s_per_1000"] for v in levels.values()) <= 1.5,  # type: ignore[union-attr]
        "added_first_chunk_ms<=5": results["streaming_c1"]["added_first_chunk_ms"] <= 5,  # type: ignore[index]
    }
    if "1" in levels:
        goals["added_p50_ms_at_c1<=2"] = levels["1"]["added_p50_ms"] <= 2  # type: ignore[index]
    if "64" in levels:
        goals["throughput_ratio_at_c64>=0.25"] = levels["64"]["throughput_ratio"] >= 0.25  # type: ignore[index]
    results["goals"] = goals
    print(json.dumps({"stub": {"latency_ms": args.latency_ms, "tokens": args.tokens}, **results}, indent=2))


# --engine sglang ---------------------------------------------------------------------------------------------

ADDED_P50_GOAL_MS = 2.0
FIRST_CHUNK_GOAL_MS = 5.0
SIDES = ("direct", "relay", "proxy")


@dataclass
class Shot:
    """One request as its client saw it."""

    latency: float
    first: float | None
    """Seconds to the first ``data:`` event with content (streamed requests)."""
    text: str
    engine: float | None = None
    """The engine's time as the proxy measured it (its ``Server-Timing`` header; non-streamed proxied requests)."""


def _has_content(line: str) -> bool:
    payload = line[5:].strip()
    if payload == "[DONE]":
        return False
    chunk = json.loads(payload)
    return any((c.get("delta") or {}).get("content") for c in chunk.get("choices") or ())


def _stream_text(lines: list[str]) -> str:
    parts = []
    for line in lines:
        payload = line[5:].strip()
        if payload != "[DONE]":
            for c in json.loads(payload).get("choices") or ():
                parts.append((c.get("delta") or {}).get("content") or "")
    return "".join(parts)


def _server_timing(headers: httpx.Headers) -> float | None:
    value = headers.get("server-timing")
    if value is None or ";dur=" not in value:
        return None
    return float(value.partition(";dur=")[2]) / 1000


async def shot(
    http: httpx.AsyncClient, url: str, body: dict[str, Any], headers: dict[str, str], max_tokens: int
) -> Shot:
    """One request; the response is parsed only after the clock stopped (streamed: until the first content)."""
    t0 = time.perf_counter()
    if body.get("stream"):
        lines: list[str] = []
        first = None
        async with http.stream("POST", url, json=body, headers=headers) as r:
            if r.status_code != 200:
                raise RuntimeError(f"{url}: {r.status_code} {(await r.aread())[:500]!r}")
            async for line in r.aiter_lines():
                if line.startswith("data:"):
                    if first is None and _has_content(line):
                        first = time.perf_counter() - t0
                    lines.append(line)
        latency = time.perf_counter() - t0
        if not lines or lines[-1][5:].strip() != "[DONE]":
            raise RuntimeError(f"{url}: the stream ended without [DONE]")
        return Shot(latency, first, _stream_text(lines))
    r = await http.post(url, json=body, headers=headers)
    latency = time.perf_counter() - t0
    if r.status_code != 200:
        raise RuntimeError(f"{url}: {r.status_code} {r.text[:500]}")
    data = r.json()
    tokens = data["usage"]["completion_tokens"]
    if tokens != max_tokens:
        raise RuntimeError(f"{url}: {tokens} tokens generated, {max_tokens} asked (ignore_eos)")
    return Shot(latency, None, data["choices"][0]["message"]["content"], _server_timing(r.headers))


@dataclass
class Side:
    shots: list[Shot] = field(default_factory=list)
    round_medians: list[float] = field(default_factory=list)
    round_first_medians: list[float] = field(default_factory=list)
    wall: float = 0.0
    cpu: dict[str, float] = field(default_factory=dict)
    """CPU seconds of each measured process (the proxy, the relay) during this side's rounds."""

    def summary(self) -> dict[str, float]:
        out = {
            "p50_ms": 1000 * statistics.median(s.latency for s in self.shots),
            "rps": len(self.shots) / self.wall,
        }
        firsts = [s.first for s in self.shots if s.first is not None]
        if firsts:
            out["first_chunk_p50_ms"] = 1000 * statistics.median(firsts)
        own = [s.latency - s.engine for s in self.shots if s.engine is not None]
        if own:
            out["beyond_engine_p50_ms"] = 1000 * statistics.median(own)
        return out


async def sglang_cell(
    urls: dict[str, str],
    body: dict[str, Any],
    concurrency: int,
    requests: int,
    pids: dict[str, int],
    tag: str,
) -> dict[str, Side]:
    """``requests`` (rounded up to whole rounds) per side, in rounds of ``concurrency`` at once: straight to the
    engine, through the TCP relay, through the proxy, the order rotating every round so that no side always
    follows another (the proxy publishes the turns of its round during the next one). The direct and relayed
    bodies ask SGLang for what the proxy adds to a main turn."""
    exact = EXACT_STREAMED if body.get("stream") else EXACT_NON_STREAMED
    bodies = {"direct": {**body, **exact}, "relay": {**body, **exact}, "proxy": body}
    sides = {name: Side() for name in SIDES}
    # One client (one connection) per request in flight, on each side.
    clients = {side: [httpx.AsyncClient(timeout=600) for _ in range(concurrency)] for side in sides}
    try:
        for r in range(math.ceil(requests / concurrency)):
            for name in SIDES[r % 3 :] + SIDES[: r % 3]:
                side = sides[name]
                cpu0 = {proc: cpu_seconds(pid) for proc, pid in pids.items()}
                t0 = time.perf_counter()
                shots = await asyncio.gather(
                    *(
                        shot(
                            clients[name][k],
                            urls[name],
                            bodies[name],
                            {"X-Session-Id": f"bench-{tag}-{r}-{k}"},
                            body["max_tokens"],
                        )
                        for k in range(concurrency)
                    )
                )
                side.wall += time.perf_counter() - t0
                for proc, pid in pids.items():
                    side.cpu[proc] = side.cpu.get(proc, 0.0) + cpu_seconds(pid) - cpu0[proc]
                side.shots += shots
                side.round_medians.append(statistics.median(s.latency for s in shots))
                firsts = [s.first for s in shots if s.first is not None]
                if firsts:
                    side.round_first_medians.append(statistics.median(firsts))
    finally:
        for cs in clients.values():
            for c in cs:
                await c.aclose()
    return sides


def paired_ms(proxy: list[float], direct: list[float]) -> float:
    """Median over rounds of (proxy - direct), in ms."""
    return 1000 * statistics.median(p - d for p, d in zip(proxy, direct, strict=True))


def sglang_figures(sides: dict[str, Side], stream: bool) -> dict[str, Any]:
    """One cell's figures: each side's, then what the relay and the proxy add to going direct (p50 difference,
    and the median over rounds of the round medians' difference), and the proxy against the relay."""
    direct, relay, via = sides["direct"], sides["relay"], sides["proxy"]
    d, r, p = direct.summary(), relay.summary(), via.summary()
    cell: dict[str, Any] = {
        "requests_per_side": len(via.shots),
        **{
            name: {k: round(v, 3) for k, v in fig.items()}
            for name, fig in (("direct", d), ("relay", r), ("proxy", p))
        },
        "added_p50_ms": round(p["p50_ms"] - d["p50_ms"], 2),
        "added_paired_median_ms": round(paired_ms(via.round_medians, direct.round_medians), 2),
        "relay_added_p50_ms": round(r["p50_ms"] - d["p50_ms"], 2),
        "relay_added_paired_median_ms": round(paired_ms(relay.round_medians, direct.round_medians), 2),
        "proxy_minus_relay_p50_ms": round(p["p50_ms"] - r["p50_ms"], 2),
    }
    if "beyond_engine_p50_ms" in p:
        cell["proxy_beyond_engine_p50_ms"] = round(p["beyond_engine_p50_ms"], 2)
    if stream:
        cell["added_first_chunk_ms"] = round(p["first_chunk_p50_ms"] - d["first_chunk_p50_ms"], 2)
        cell["added_first_chunk_paired_median_ms"] = round(
            paired_ms(via.round_first_medians, direct.round_first_medians), 2
        )
        cell["relay_added_first_chunk_ms"] = round(r["first_chunk_p50_ms"] - d["first_chunk_p50_ms"], 2)
    cell |= {
        "throughput_ratio": round(p["rps"] / d["rps"], 3),
        "proxy_cpu_s_per_1000": round(1000 * via.cpu["proxy"] / len(via.shots), 3),
        "relay_cpu_s_per_1000": round(1000 * relay.cpu["relay"] / len(relay.shots), 3),
        "proxy_cpu_other_rounds_ms_per_s": round(
            1000 * (direct.cpu["proxy"] + relay.cpu["proxy"]) / (direct.wall + relay.wall), 2
        ),
    }
    goals = {f"added_p50_ms<={ADDED_P50_GOAL_MS:g}": cell["added_p50_ms"] <= ADDED_P50_GOAL_MS}
    if stream:
        goals[f"added_first_chunk_ms<={FIRST_CHUNK_GOAL_MS:g}"] = (
            cell["added_first_chunk_ms"] <= FIRST_CHUNK_GOAL_MS
        )
    cell["goals"] = goals
    return cell


def start_relay(engine_url: str) -> tuple[subprocess.Popen[bytes], int]:
    """bench/tcp_relay.py in front of the engine: its process and port."""
    target = httpx.URL(engine_url)
    port = free_port()
    relay = subprocess.Popen(
        [sys.executable, str(REPO / "bench" / "tcp_relay.py"), str(port), target.host, str(target.port)]
    )
    return relay, port


def run_sglang(args: argparse.Namespace) -> None:
    requests = args.requests if args.requests is not None else 64
    levels = [int(x) for x in (args.levels or "1,8").split(",")]
    started: Started = []
    engine: EngineProcess | None = None
    engine_log = None
    proxy: subprocess.Popen[bytes] | None = None
    relay: subprocess.Popen[bytes] | None = None
    cells: dict[str, dict[str, Any]] = {}
    results: dict[str, Any] = {}
    try:
        if args.engine_url:
            engine_url = args.engine_url.rstrip("/")
        else:
            from runtime.engine.model_store import fetch_smollm2

            log = tempfile.NamedTemporaryFile(
                "w", prefix="turnstream-bench-sglang-", suffix=".log", delete=False
            )
            engine_log = log.name
            engine = EngineProcess(fetch_smollm2(log=False), log=log)
            engine_url = engine.url
        version = httpx.get(engine_url + "/server_info", timeout=30).json().get("version")
        model = httpx.get(engine_url + "/v1/models", timeout=30).json()["data"][0]["id"]
        bootstrap, redis_url, namespace, kafka = bench_kafka(started)
        proxy, proxy_port = start_proxy(engine_url, bootstrap, redis_url, namespace)
        relay, relay_port = start_relay(engine_url)
        wait_http(f"http://127.0.0.1:{proxy_port}/metrics")
        wait_http(f"http://127.0.0.1:{relay_port}/v1/models")
        pids = {"proxy": proxy.pid, "relay": relay.pid}
        urls = {
            "direct": engine_url + "/v1/chat/completions",
            "relay": f"http://127.0.0.1:{relay_port}/v1/chat/completions",
            "proxy": f"http://127.0.0.1:{proxy_port}/v1/chat/completions",
        }
        # Every sampling value the proxy would pin on a main turn is given, greedy: it adds only the ids and
        # log-probs, which the direct requests ask for too; both sides generate the same tokens.
        body: dict[str, Any] = {
            "model": model,
            "messages": [{"role": "user", "content": SGLANG_PROMPT}],
            "max_tokens": args.max_tokens,
            **OPENAI_SAMPLING,
            "temperature": 0.0,
            "ignore_eos": True,
        }
        sent_main = 0
        texts: set[str] = set()
        for stream in (False, True):  # warm-up: connections, the prompt's prefix cache, first-use paths
            sides = asyncio.run(sglang_cell(urls, {**body, "stream": stream}, 1, 3, pids, f"warm{stream:d}"))
            sent_main += len(sides["proxy"].shots)
        for c in levels:
            for stream in (False, True):
                name = f"c{c}/{'streamed' if stream else 'non_streamed'}"
                tag = f"c{c}{'s' if stream else 'n'}"
                sides = asyncio.run(sglang_cell(urls, {**body, "stream": stream}, c, requests, pids, tag))
                sent_main += len(sides["proxy"].shots)
                texts |= {s.text for side in sides.values() for s in side.shots}
                cells[name] = sglang_figures(sides, stream)
        # Kafka publishing was really on: every proxied main turn reached the topic as a Turn.
        results["turns_published"] = published_turns(proxy_port, kafka)
        results["turns_expected"] = sent_main
        results["all_turns_published"] = results["turns_published"] == sent_main
        results["distinct_outputs"] = len(texts)
    finally:
        for child in (proxy, relay):
            if child is not None:
                child.terminate()
                child.wait(30)
        if engine is not None:
            engine.stop()
        stop_started(started)
    goals_met = {
        f"{name}: {goal}": met for name, cell in cells.items() for goal, met in cell["goals"].items()
    }
    print(
        json.dumps(
            {
                "engine": {
                    "server": f"SGLang {version}",
                    "expected": f"SGLang {SGLANG_VERSION}",
                    "model": model,
                    "started_here": engine_log is not None,
                    **({"log": engine_log} if engine_log else {"url": engine_url}),
                },
                "request": {
                    "prompt": SGLANG_PROMPT,
                    "max_tokens": args.max_tokens,
                    "temperature": 0,
                    "ignore_eos": True,
                    "requests_per_cell_and_side": requests,
                    "levels": levels,
                    "order": "rounds of C requests at once: direct, relay, proxy, rotating by one each round",
                },
                "cells": cells,
                **results,
                "goals": goals_met,
                "all_goals_met": all(goals_met.values()),
            },
            indent=2,
        )
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", choices=("stub", "sglang"), default="stub")
    ap.add_argument(
        "--requests",
        type=int,
        default=None,
        help="stub: requests per concurrency level and side (600); sglang: per cell and side (64)",
    )
    ap.add_argument(
        "--levels", default=None, help="concurrency levels, comma-separated (stub 1,16,64; sglang 1,8)"
    )
    ap.add_argument("--latency-ms", type=float, default=20.0, help="stub only")
    ap.add_argument("--tokens", type=int, default=60, help="stub only")
    ap.add_argument("--engine-url", default=None, help="sglang only: measure this running SGLang")
    ap.add_argument("--max-tokens", type=int, default=8, help="sglang only: tokens per response")
    args = ap.parse_args()
    if args.engine == "stub":
        run_stub(args)
    else:
        run_sglang(args)


if __name__ == "__main__":
    main()

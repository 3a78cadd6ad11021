"""What the proxy adds, measured side by side against going straight to the engine, in one run. Prints JSON.

    .venv/bin/python bench/proxy.py [--requests 600] [--latency-ms 20] [--tokens 60]

A stub engine (bench/stub_engine.py, its own process) answers after a fixed latency with a fixed number of
tokens and their log-probs. The proxy runs as ``turnstream proxy`` with Kafka publishing on (Kafka and Redis
from scripts/ unless TURNSTREAM_KAFKA_BOOTSTRAP / TURNSTREAM_REDIS_URL are set). For concurrency 1, 16 and 64:
latency p50/p99 and requests/s direct vs through the proxy; time to first streamed chunk; the proxy's own CPU
time per 1,000 requests (from /proc). At the end every recorded turn must have reached Kafka.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx
from infra import Started, start_kafka, start_redis, stop_started

from services.bus import read_topic
from services.config import KafkaConfig
from services.engine.launch import free_port
from services.topics import create_topics

REPO = Path(__file__).resolve().parent.parent
BODY = {"model": "stub", "messages": [{"role": "user", "content": "Tell me something."}], "max_tokens": 60}
TICKS = os.sysconf("SC_CLK_TCK")


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


async def load(url: str, concurrency: int, total: int, stream: bool, headers_for: object) -> dict[str, float]:
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
                    async with http.stream("POST", url, json={**BODY, "stream": True}, headers=headers) as r:
                        assert r.status_code == 200
                        first = None
                        async for line in r.aiter_lines():
                            if first is None and line.startswith("data:"):
                                first = time.perf_counter() - t0
                    firsts.append(first or 0.0)
                else:
                    r = await http.post(url, json=BODY, headers=headers)
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


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=600, help="requests per concurrency level and side")
    ap.add_argument("--latency-ms", type=float, default=20.0)
    ap.add_argument("--tokens", type=int, default=60)
    ap.add_argument("--levels", default="1,16,64", help="concurrency levels, comma-separated")
    args = ap.parse_args()

    started: Started = []
    bootstrap, redis_url = start_kafka(started), start_redis(started)
    namespace = f"bench-{uuid.uuid4().hex[:8]}."
    kafka = KafkaConfig(bootstrap=bootstrap, namespace=namespace)
    asyncio.run(create_topics(kafka, partitions=3))
    stub_port, proxy_port = free_port(), free_port()
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
    tmp = tempfile.mkdtemp(prefix="turnstream-bench-")
    env = {
        **os.environ,
        "TURNSTREAM_KAFKA_BOOTSTRAP": bootstrap,
        "TURNSTREAM_KAFKA_NAMESPACE": namespace,
        "TURNSTREAM_REDIS_URL": redis_url,
        "TURNSTREAM_REDIS_KEY_PREFIX": namespace,
        "TURNSTREAM_ENGINE_URL": f"http://127.0.0.1:{stub_port}",
        "TURNSTREAM_PROXY_PORT": str(proxy_port),
        "TURNSTREAM_PROXY_SPOOL_DIR": tmp + "/spool",
        "TURNSTREAM_PROXY_WEIGHTS_ROOT": tmp,
        "TURNSTREAM_LOGGING_LEVEL": "WARNING",
    }
    proxy = subprocess.Popen([sys.executable, "-m", "services.cli", "proxy"], env=env, cwd=REPO)
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
        for c in [int(x) for x in args.levels.split(",")]:
            n = max(args.requests // (4 if c == 1 else 1), 2 * c)
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
        n = max(args.requests // 4, 50)
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

        results["turns_published"] = asyncio.run(count())
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


if __name__ == "__main__":
    main()

"""Routing between two policy replicas: the proxy's session affinity against round-robin, side by side in one
run, on multi-turn sessions that share a long system prompt (as agents' sessions do). Prints one JSON object.

    .venv/bin/python bench/routing.py [--sessions 12] [--turns 4] [--concurrency 4] [--system-words 300]
                                      [--turn-words 60] [--rounds 2]

Two SmolLM2 SGLang servers (``turnstream engine``, which reports cached tokens), Kafka and Redis (bench/infra.py)
and, per policy, a ``turnstream proxy`` routing between the two. Each round runs every policy once, in turn, each
with a proxy of its own after flushing both servers' prefix caches, on the same sessions (same ids and texts):
each turn sends the conversation so far plus a new user message carrying ``--turn-words`` words of its own (what
an agent's tool output adds to its context each turn; 0: a short question), greedy, 16 tokens. Figures per
policy: the prefix-cache hit rate (the prompt tokens SGLang found cached,
``usage.prompt_tokens_details.cached_tokens``, over all prompt tokens), turns per second, and the mean and p90
latency of a turn; the ratios are affinity over round-robin.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx
from infra import Started, stop_started
from proxy import bench_kafka, start_proxy

from runtime.engine.model_store import fetch_smollm2
from services.engine.launch import EngineProcess

WORDS = "the policy learns from every turn that its users take with it through the proxy".split()


def system_prompt(words: int) -> str:
    return "You are a coding agent. " + " ".join(WORDS[i % len(WORDS)] for i in range(words))


async def session(
    http: httpx.AsyncClient, url: str, name: str, args: argparse.Namespace, out: list[dict[str, float]]
) -> None:
    messages: list[dict[str, str]] = [
        {"role": "system", "content": system_prompt(args.system_words)},
        {"role": "user", "content": f"Task {name}: write a function that adds two numbers."},
    ]
    for turn in range(args.turns):
        began = time.perf_counter()
        resp = await http.post(
            url + "/v1/chat/completions",
            json={"messages": messages, "max_tokens": 16, "temperature": 0},
            headers={"X-Session-Id": name},
        )
        resp.raise_for_status()
        data = resp.json()
        usage = data["usage"]
        out.append(
            {
                "seconds": time.perf_counter() - began,
                "prompt": usage["prompt_tokens"],
                "cached": (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0,
            }
        )
        output = " ".join(f"{name}-{turn}-{i}" for i in range(args.turn_words))  # this session's own text
        messages += [
            {"role": "assistant", "content": data["choices"][0]["message"]["content"] or ""},
            {
                "role": "user",
                "content": f"Tool output: {output}\nNow step {turn + 2}: handle {turn + 2} numbers.",
            },
        ]


async def drive(url: str, args: argparse.Namespace, tag: str) -> dict[str, float]:
    out: list[dict[str, float]] = []
    gate = asyncio.Semaphore(args.concurrency)

    async def one(i: int) -> None:
        async with gate:
            await session(http, url, f"{tag}-{i}", args, out)

    async with httpx.AsyncClient(timeout=600) as http:
        began = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(args.sessions)))
        wall = time.perf_counter() - began
    lat = sorted(r["seconds"] for r in out)
    prompt, cached = sum(r["prompt"] for r in out), sum(r["cached"] for r in out)
    return {
        "turns": len(out),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "hit_rate": round(cached / prompt, 4),
        "turns_per_s": round(len(out) / wall, 3),
        "mean_s": round(statistics.mean(lat), 3),
        "p90_s": round(lat[int(len(lat) * 0.9)], 3),
        "wall_s": round(wall, 1),
    }


def flush(engines: list[EngineProcess]) -> None:
    for engine in engines:
        httpx.post(engine.url + "/flush_cache", timeout=60).raise_for_status()


def wait_ready(port: int) -> None:
    deadline = time.monotonic() + 120
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError("the proxy did not start")
        time.sleep(0.3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sessions", type=int, default=12)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--system-words", type=int, default=300)
    ap.add_argument("--turn-words", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    model = fetch_smollm2()
    logs = Path(tempfile.mkdtemp(prefix="turnstream-routing-"))
    engines = [EngineProcess(model, log=open(logs / f"engine-{i}.log", "w"), wait=False) for i in range(2)]
    started: Started = []
    results: dict[str, list[dict[str, float]]] = {"affinity": [], "round_robin": []}
    try:
        for engine in engines:
            engine.wait_ready(engine.ready_path)
        bootstrap, redis_url, namespace, _ = bench_kafka(started)
        replicas = ",".join(e.url for e in engines)
        for r in range(args.rounds):
            for policy in results:
                flush(engines)
                proc, port = start_proxy(
                    engines[0].url,
                    bootstrap,
                    redis_url,
                    namespace,
                    {"TURNSTREAM_ENGINE_REPLICAS": replicas, "TURNSTREAM_PROXY_ROUTING": policy},
                )
                try:
                    wait_ready(port)
                    results[policy].append(asyncio.run(drive(f"http://127.0.0.1:{port}", args, f"s{r}")))
                finally:
                    proc.terminate()
                    proc.wait(60)
    finally:
        for engine in engines:
            engine.stop()
        stop_started(started)

    def mean(policy: str, key: str) -> float:
        return statistics.mean(run[key] for run in results[policy])

    print(
        json.dumps(
            {
                "settings": vars(args),
                "runs": results,
                "hit_rate": {p: round(mean(p, "hit_rate"), 4) for p in results},
                "turns_per_s_ratio_affinity_over_round_robin": round(
                    mean("affinity", "turns_per_s") / mean("round_robin", "turns_per_s"), 3
                ),
                "mean_latency_ratio_affinity_over_round_robin": round(
                    mean("affinity", "mean_s") / mean("round_robin", "mean_s"), 3
                ),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()

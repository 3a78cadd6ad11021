"""Judge throughput against a stub judge engine with a fixed latency per call, in one run. Prints JSON.

    .venv/bin/python bench/judge.py [--turns 600] [--latency-ms 50] [--concurrency 8]

The same paired turns are judged by ``turnstream judge`` processes under a fresh judge id per scenario (its own
consumer group, so each scenario reads the whole topic): one worker at m=1, one at m=3, and two workers sharing
one judge id at m=1. Throughput is paired turns per second between the first and the last judgment's timestamp
(steady state, startup and group joins excluded). The ideal is the engine-bound rate
concurrency / (2m calls x latency) per worker; efficiency is measured / ideal.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from infra import Started, start_kafka, start_redis, stop_started
from tqdm import tqdm

from runtime.configuration.config import KafkaConfig
from runtime.messaging.bus import EventProducer, read_topic
from runtime.messaging.topics import create_topics
from runtime.process.launch import ServiceProcess
from runtime.process.ports import free_port
from schemas import Judgment, Message, PairedTurn, Turn
from schemas.topics import JUDGMENTS, TURNS_PAIRED

REPO = Path(__file__).resolve().parent.parent


def paired_turns(n: int) -> list[PairedTurn]:
    """Realistic sizes: a few hundred prompt tokens, ~60 response tokens; a third of next states correct."""
    now = time.time()
    out = []
    for i in range(n):
        sid = f"s{i % 50}"
        turn = Turn(
            turn_id=f"{sid}:{i + 1}",
            session_id=sid,
            turn_index=i + 1,
            messages=[
                Message(role="system", content="You are a helpful assistant. " * 10),
                Message(role="user", content=f"Question {i}: how do I configure the thing? " * 4),
            ],
            response=Message(role="assistant", content="Here is how you configure it. " * 8),
            prompt_token_ids=list(range(300)),
            response_token_ids=list(range(1000, 1060)),
            response_logprobs=[-0.5] * 60,
            finish_reason="stop",
            weight_version=0,
            model="bench",
            created_at=now,
            completed_at=now,
        )
        reply = "That's wrong, use the other setting." if i % 3 == 0 else "Thanks, that worked."
        out.append(PairedTurn(turn=turn, next_state=[Message(role="user", content=reply)], paired_at=now))
    return out


async def publish(kafka: KafkaConfig, pairs: list[PairedTurn]) -> None:
    async with EventProducer(kafka) as producer:
        for p in pairs:
            await producer.send_nowait(TURNS_PAIRED, p, p.turn.session_id)
        await producer.flush()


async def judgments(kafka: KafkaConfig) -> list[Judgment]:
    return [r.event async for r in read_topic(kafka, JUDGMENTS)]


def scenario(
    kafka: KafkaConfig, stub_url: str, judge_id: str, workers: int, m: int, n: int, concurrency: int
) -> dict[str, float]:
    env = {
        "TURNSTREAM_KAFKA_BOOTSTRAP": kafka.bootstrap,
        "TURNSTREAM_KAFKA_NAMESPACE": kafka.namespace,
        "TURNSTREAM_KAFKA_SEAL_KEYS_URL": kafka.seal_keys_url,
        "TURNSTREAM_JUDGE_BACKEND": "engine",
        "TURNSTREAM_JUDGE_ENGINE_URL": stub_url,
        "TURNSTREAM_JUDGE_MAX_CONCURRENCY": str(concurrency),
        "TURNSTREAM_JUDGE_M": str(m),
        "TURNSTREAM_LOGGING_LEVEL": "WARNING",
        "OMP_NUM_THREADS": "1",
    }
    procs = []
    for _ in range(workers):
        port = free_port()
        procs.append(
            ServiceProcess(
                ["judge", "--judge-id", judge_id],
                port=port,
                ready_path="/metrics",
                env={**env, "TURNSTREAM_METRICS_PORT": str(port)},
            )
        )
    try:
        bar = tqdm(total=n, desc=f"{judge_id}", unit="turn", file=sys.stderr)
        deadline = time.monotonic() + 600
        while True:
            mine = [j for j in asyncio.run(judgments(kafka)) if j.judge_id == judge_id and j.kind == "hint"]
            bar.update(len({j.turn_id for j in mine}) - bar.n)
            if len({j.turn_id for j in mine}) >= n or time.monotonic() > deadline:
                break
            time.sleep(1)
        bar.close()
    finally:
        for p in procs:
            p.stop()
    mine = [j for j in asyncio.run(judgments(kafka)) if j.judge_id == judge_id]
    stamps = sorted(j.created_at for j in mine)
    judged = len({j.turn_id for j in mine})
    seconds = stamps[-1] - stamps[0]
    rate = (judged - 1) / seconds if seconds > 0 else float("nan")
    return {"workers": workers, "m": m, "turns_judged": judged, "turns_per_s": round(rate, 1)}


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--turns", type=int, default=600)
    ap.add_argument("--latency-ms", type=float, default=50.0)
    ap.add_argument("--concurrency", type=int, default=8, help="judge.max_concurrency per worker")
    args = ap.parse_args()
    started: Started = []
    bootstrap = start_kafka(started)
    # Paired turns and judgments are sealed per session, as in production: the keys live in a Redis.
    keys_url = start_redis(started)
    kafka = KafkaConfig(
        bootstrap=bootstrap, seal_keys_url=keys_url, namespace=f"bench-{uuid.uuid4().hex[:8]}."
    )
    stub_port = free_port()
    stub = subprocess.Popen(
        [
            sys.executable,
            str(REPO / "bench/stub_judge.py"),
            "--port",
            str(stub_port),
            "--latency-ms",
            str(args.latency_ms),
        ]
    )
    results = {}
    try:
        asyncio.run(create_topics(kafka, partitions=6))
        asyncio.run(publish(kafka, paired_turns(args.turns)))
        url = f"http://127.0.0.1:{stub_port}"
        for name, workers, m in (("one_worker_m1", 1, 1), ("one_worker_m3", 1, 3), ("two_workers_m1", 2, 1)):
            r = scenario(kafka, url, name.replace("_", "-"), workers, m, args.turns, args.concurrency)
            ideal = workers * args.concurrency / (2 * m * args.latency_ms / 1000)
            r["ideal_turns_per_s"] = round(ideal, 1)
            r["efficiency"] = round(r["turns_per_s"] / ideal, 3)
            results[name] = r
    finally:
        stub.terminate()
        stop_started(started)
    one = results["one_worker_m1"]["turns_per_s"]
    summary = {
        "m3_over_m1": round(results["one_worker_m3"]["turns_per_s"] / one, 3),
        "two_workers_over_one": round(results["two_workers_m1"]["turns_per_s"] / one, 3),
    }
    out = {"stub": {"latency_ms": args.latency_ms}, "concurrency": args.concurrency, **results, **summary}
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()

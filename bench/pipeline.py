"""The whole pipeline's speed: synthetic sessions through proxy -> pairer -> judge -> teacher -> dispatcher with
stub engines at fixed latencies, once with one judge worker and once with two (one judge id, so they share the
work), in one run. Prints JSON.

    .venv/bin/python bench/pipeline.py [--sessions 48] [--turns 6] [--concurrency 16] [--judge-latency-ms 100]

Per scenario: end-to-end turns per second (samples on ``samples`` over the time from the first request to the
last sample), the latency from a next state's arrival at the proxy (the user's following request) to its
``Sample`` (p50/p99), each consumer group's lag sampled every second (max and mean), and the per-id account
(every judged turn must have exactly one sample). The judge is the slow stage by construction (its stub answers
after ``--judge-latency-ms`` with ``--judge-concurrency`` calls in flight per worker, two calls per turn), so
the second worker's gain is what this measures; with two cores shared by a dozen processes, the CPU is the
other limit.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from infra import Started, start_kafka, start_redis, stop_started
from pipeline_rig import GROUPS, JUDGE_ID, Pipeline, Stages, account, drive, read_all, request_of
from tqdm import tqdm

from runtime.configuration.config import (
    DispatcherConfig,
    JudgeConfig,
    KafkaConfig,
    PairerConfig,
    TeacherConfig,
)
from runtime.engine.model_store import fetch_smollm2
from runtime.messaging.bus import read_topic
from runtime.messaging.topics import create_topics, group_lag
from schemas.topics import SAMPLES

STAGE = {
    PairerConfig().group_id: "pairer",
    JudgeConfig(judge_id=JUDGE_ID).group_id: "judge",
    TeacherConfig().group_id: "teacher",
    DispatcherConfig().group_id: "dispatcher",
}


def pct(values: list[float], q: float) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, int(len(v) * q))] if v else float("nan")


async def count_samples(kafka: KafkaConfig) -> int:
    return sum([1 async for _ in read_topic(kafka, SAMPLES)])


async def run_scenario(
    name: str, bootstrap: str, redis_url: str, tokenizer: str, stages: Stages, args: argparse.Namespace
) -> dict[str, object]:
    ns = f"bench-{uuid.uuid4().hex[:8]}."
    kafka = KafkaConfig(bootstrap=bootstrap, namespace=ns)
    await create_topics(kafka, partitions=4)
    workdir = Path(tempfile.mkdtemp(prefix=f"turnstream-pipeline-{name}-"))
    pipe = await asyncio.to_thread(Pipeline(kafka, redis_url, ns, tokenizer, workdir, stages).start)
    expected_samples = args.sessions * (args.turns - 1)
    lags: dict[str, list[int]] = {g: [] for g in GROUPS}
    stop = asyncio.Event()

    async def sample_lag() -> None:
        while not stop.is_set():
            try:
                for group, n in (await group_lag(kafka, GROUPS)).items():
                    lags[group].append(n)
            except Exception as exc:  # the sampler must not end the run; the gap shows in the count
                print(f"lag sample failed: {exc!r}", file=sys.stderr)
            try:
                await asyncio.wait_for(stop.wait(), 1.0)
            except TimeoutError:
                pass

    try:
        sampler = asyncio.create_task(sample_lag())
        bar = tqdm(total=args.sessions * args.turns, desc=f"{name}: turns", unit="turn", file=sys.stderr)
        driven = await drive(
            pipe.proxy_url, args.sessions, args.turns, args.concurrency, "s", progress=lambda: bar.update(1)
        )
        bar.close()
        bar = tqdm(total=expected_samples, desc=f"{name}: samples", unit="sample", file=sys.stderr)
        deadline = time.monotonic() + args.timeout_s
        while (n := await count_samples(kafka)) < expected_samples and time.monotonic() < deadline:
            bar.update(n - bar.n)
            await asyncio.sleep(1.0)
        bar.update(n - bar.n)
        bar.close()
        stop.set()
        await sampler
    finally:
        await asyncio.to_thread(pipe.stop)
    topics = await read_all(kafka)
    acc = account(topics, driven, "s")
    turn_of = {t.turn_id: request_of(t) for t in topics.turns}
    latencies = []
    for s in topics.samples:
        key = turn_of.get(s.sample_id)
        if key in driven.next_state_at:
            latencies.append(s.created_at - driven.next_state_at[key])  # type: ignore[index]
    last = max(s.created_at for s in topics.samples) if topics.samples else driven.ended_at
    span = last - driven.started_at
    return {
        "turns_answered": len(driven.answered),
        "proxy_turns_per_s": round(len(driven.answered) / (driven.ended_at - driven.started_at), 1),
        "samples": len(topics.samples),
        "end_to_end_turns_per_s": round(len(topics.samples) / span, 1) if span > 0 else None,
        "next_state_to_sample_ms": {
            "p50": round(1000 * pct(latencies, 0.5), 1),
            "p99": round(1000 * pct(latencies, 0.99), 1),
            "measured": len(latencies),
        },
        "consumer_lag": {
            STAGE[g]: {"max": max(v, default=0), "mean": round(statistics.fmean(v), 1) if v else 0.0}
            for g, v in lags.items()
        },
        "account": acc.summary(),
        "exact": acc.exact,
        "dead_letters": len(topics.dead_letters),
        "request_errors": dict(driven.errors),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sessions", type=int, default=48)
    ap.add_argument("--turns", type=int, default=6, help="turns per session (the last one ends the session)")
    ap.add_argument("--concurrency", type=int, default=16, help="sessions in flight")
    ap.add_argument("--policy-latency-ms", type=float, default=20.0)
    ap.add_argument("--judge-latency-ms", type=float, default=100.0)
    ap.add_argument("--judge-concurrency", type=int, default=4, help="judge calls in flight per worker")
    ap.add_argument("--teacher-latency-ms", type=float, default=20.0)
    ap.add_argument("--timeout-s", type=float, default=300.0, help="longest wait for the samples")
    args = ap.parse_args()
    started: Started = []
    bootstrap, redis_url = start_kafka(started), start_redis(started)
    tokenizer = str(fetch_smollm2())
    results: dict[str, object] = {}
    try:
        for name, workers in (("one_judge_worker", 1), ("two_judge_workers", 2)):
            stages = Stages(
                policy_latency_ms=args.policy_latency_ms,
                judge_latency_ms=args.judge_latency_ms,
                teacher_latency_ms=args.teacher_latency_ms,
                judge_workers=workers,
                judge_concurrency=args.judge_concurrency,
                extra_env={"TURNSTREAM_LOGGING_LEVEL": "WARNING"},
            )
            results[name] = asyncio.run(run_scenario(name, bootstrap, redis_url, tokenizer, stages, args))
    finally:
        stop_started(started)
    one, two = results["one_judge_worker"], results["two_judge_workers"]
    gain = {
        "end_to_end_turns_per_s": round(two["end_to_end_turns_per_s"] / one["end_to_end_turns_per_s"], 2),  # type: ignore[index,operator]
        "p50_latency": round(
            two["next_state_to_sample_ms"]["p50"] / one["next_state_to_sample_ms"]["p50"],  # type: ignore[index]
            2,
        ),
    }
    out = {
        "settings": {k: v for k, v in vars(args).items() if k != "timeout_s"},
        "judge_engine_bound_turns_per_s_per_worker": round(
            args.judge_concurrency / (2 * args.judge_latency_ms / 1000), 1
        ),
        **results,
        "second_judge_worker_gain": gain,
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()

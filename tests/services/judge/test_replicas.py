"""Judge replicas as real processes: two judge ids consume the same turns independently, and `kill -9` of one
replica of a group mid-stream loses nothing. After the restart every paired turn has its judgment per
(judge_id, kind), deduplicated by key: at-least-once, never missing."""

from __future__ import annotations

import asyncio
import re
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from runtime.configuration.config import KafkaConfig
from runtime.process.launch import ServiceProcess
from runtime.process.ports import free_port
from tests.services.judge.conftest import StubJudge, expected_keys, make_pairs, publish, wait_for_judgments

pytestmark = pytest.mark.integration


class JudgeProcess(ServiceProcess):
    def __init__(self, judge_id: str, env: dict[str, str], logdir: Path) -> None:
        port = free_port()
        self.logfile = open(logdir / f"judge-{judge_id}-{port}.log", "w")
        super().__init__(
            ["judge", "--judge-id", judge_id],
            port=port,
            ready_path="/metrics",
            env={**env, "TURNSTREAM_METRICS_PORT": str(port)},
            log=self.logfile,
            startup_timeout_s=60,
        )

    def judged(self) -> float:
        text = httpx.get(self.url + "/metrics", timeout=2).text
        m = re.search(r"^turnstream_judge_turns_total\{[^}]*\} (\S+)$", text, re.M)
        return float(m.group(1)) if m else 0.0

    def kill9(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self.logfile.close()

    def stop(self) -> None:
        if self.proc.poll() is None:
            super().stop()
        self.logfile.close()


async def test_kill9_one_replica_mid_stream_loses_no_judgment(
    kafka: KafkaConfig, stub_judge: Callable[..., StubJudge], tmp_path: Path
) -> None:
    stub = stub_judge(latency_ms=40)
    env = {
        **kafka.client_env(),
        "TURNSTREAM_KAFKA_SEAL_KEYS_URL": kafka.seal_keys_url,
        "TURNSTREAM_KAFKA_SESSION_TIMEOUT_MS": "6000",
        "TURNSTREAM_KAFKA_HEARTBEAT_INTERVAL_MS": "500",
        "TURNSTREAM_KAFKA_POLL_TIMEOUT_MS": "200",
        "TURNSTREAM_JUDGE_BACKEND": "engine",
        "TURNSTREAM_JUDGE_ENGINE_URL": stub.url,
        "TURNSTREAM_JUDGE_MAX_CONCURRENCY": "1",
        "TURNSTREAM_JUDGE_MAX_BATCH": "4",
    }
    procs = [JudgeProcess(jid, env, tmp_path) for jid in ("a", "a", "b")]
    victim = procs[0]
    try:
        await asyncio.sleep(3)  # both replicas of "a" have joined and split the partitions
        pairs = make_pairs(120)
        await publish(kafka, pairs)
        deadline = time.monotonic() + 60
        while victim.judged() < 3:
            assert time.monotonic() < deadline, "the first replica never got work"
            await asyncio.sleep(0.1)
        victim.kill9()
        partial = await wait_for_judgments(kafka, lambda js: True)
        want_a, want_b = expected_keys(pairs, ["a"]), expected_keys(pairs, ["b"])
        assert not want_a <= {j.key for j in partial}, "killed after the stream was over: not mid-stream"
        procs.append(JudgeProcess("a", env, tmp_path))
        found = await wait_for_judgments(
            kafka, lambda js: {j.key for j in js} >= want_a | want_b, timeout=120
        )
    finally:
        for p in procs:
            p.stop()
    found_keys = {j.key for j in found}
    assert found_keys == want_a | want_b, f"missing: {sorted((want_a | want_b) - found_keys)[:5]}"
    per_key = Counter(j.key for j in found)
    assert all(n == 1 for k, n in per_key.items() if k.split("/")[1] == "b"), "judge b was never disturbed"
    # Duplicates of "a" are allowed (the killed replica's uncommitted batch is judged again), bounded by a batch
    # per partition it held.
    dupes = sum(n - 1 for n in per_key.values())
    assert dupes <= 2 * 4 * 3

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec
import pytest

from runtime.configuration.config import Config, JudgeConfig, KafkaConfig
from runtime.messaging.bus import EventProducer
from runtime.process.launch import ServiceProcess
from runtime.process.ports import free_port
from schemas import Judgment, Message, PairedTurn
from schemas.topics import JUDGMENTS, TURNS_PAIRED
from tests.kafka_wait import wait_for_events
from tests.strategies import example_turn

REPO = Path(__file__).resolve().parents[3]


class StubJudge(ServiceProcess):
    """bench/stub_judge.py in a subprocess: an engine that answers judge prompts after a fixed latency."""

    def __init__(self, latency_ms: float = 5, fail_every: int = 0, fail_status: int = 500, port: int = 0):
        port = port or free_port()
        args = ["--port", str(port), "--latency-ms", str(latency_ms), "--fail-every", str(fail_every)]
        super().__init__(
            [*args, "--fail-status", str(fail_status)],
            port=port,
            ready_path="/health",
            startup_timeout_s=30,
            program=[sys.executable, str(REPO / "bench/stub_judge.py")],
        )


@pytest.fixture
def stub_judge() -> Iterator[Callable[..., StubJudge]]:
    started: list[StubJudge] = []

    def start(**kw: object) -> StubJudge:
        s = StubJudge(**kw)  # type: ignore[arg-type]
        started.append(s)
        return s

    yield start
    for s in started:
        s.stop()


def judge_config(kafka: KafkaConfig, **judge: object) -> Config:
    return Config(kafka=kafka, judge=msgspec.convert(judge, JudgeConfig))


def make_pairs(n: int, session: str = "s") -> list[PairedTurn]:
    """n paired turns across a few sessions: every third a correction, every third thanks, every third neutral,
    plus one terminal pairing per session (which judges skip)."""
    out = []
    replies = ["No, that's wrong: I asked for Celsius.", "Thanks, perfect!", "What about tomorrow?"]
    for i in range(n):
        sid = f"{session}{i % 4}"
        turn = example_turn(sid, i + 1)
        out.append(
            PairedTurn(
                turn=turn, next_state=[Message(role="user", content=replies[i % 3])], paired_at=time.time()
            )
        )
    for k in range(4):
        terminal = example_turn(f"{session}{k}", n + 1 + k, session_done=True)
        out.append(
            PairedTurn(turn=terminal, next_state=None, paired_at=time.time(), terminal_reason="session_done")
        )
    return out


async def publish(kafka: KafkaConfig, pairs: list[PairedTurn]) -> None:
    async with EventProducer(kafka) as producer:
        for p in pairs:
            await producer.send(TURNS_PAIRED, p, p.turn.session_id)


async def wait_for_judgments(
    kafka: KafkaConfig, done: Callable[[list[Judgment]], bool], timeout: float = 60.0
) -> list[Judgment]:
    return await wait_for_events(kafka, JUDGMENTS, done, timeout)


def expected_keys(pairs: list[PairedTurn], judge_ids: list[str]) -> set[str]:
    return {
        f"{p.turn_id}/{j}/{kind}"
        for p in pairs
        if p.next_state is not None
        for j in judge_ids
        for kind in ("eval", "hint")
    }

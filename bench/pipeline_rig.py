"""The whole pipeline (proxy -> pairer -> judge -> teacher -> dispatcher) as real processes against stub engines,
driven by synthetic sessions, and the per-id account of what came out: shared by bench/pipeline.py and the
fault-injection tests (tests/test_faults.py).

Stub engines (own processes, SGLang's shapes): the policy (bench/stub_engine.py), the judge (bench/stub_judge.py,
which reads its verdict from the next state) and the teacher (bench/stub_engine.py's /generate scoring). Every
service is ``python -m services.cli <name>`` with its settings in TURNSTREAM_* variables and its log appended to
``<workdir>/<name>.log`` (a restart continues the same file).

The synthetic sessions make every outcome predictable from the turn id alone: turn k of session s is followed by
the user's turn k+1, which says the answer was wrong for one turn in three (the judge then gives -1 and a hint the
teacher scores) and thanks otherwise (+1, no hint); the last turn of a session is marked done (a terminal pairing:
no judgment, no sample). ``expected()`` derives, per turn id, what each topic must hold; ``Account`` compares.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from runtime.configuration.config import (
    DispatcherConfig,
    JudgeConfig,
    KafkaConfig,
    PairerConfig,
    TeacherConfig,
)
from runtime.messaging.bus import read_topic
from runtime.process.launch import ServiceProcess
from runtime.process.ports import free_port
from schemas import DeadLetter, Judgment, PairedTurn, Sample, TeacherScores, Turn, WeightsPublished
from schemas.topics import DEADLETTER, JUDGMENTS, SAMPLES, TEACHER, TURNS, TURNS_PAIRED, WEIGHTS

REPO = Path(__file__).resolve().parent.parent
JUDGE_ID = "rig"
GROUPS = {
    PairerConfig().group_id: (TURNS,),
    JudgeConfig(judge_id=JUDGE_ID).group_id: (TURNS_PAIRED,),
    TeacherConfig().group_id: (JUDGMENTS,),
    DispatcherConfig().group_id: (JUDGMENTS, TEACHER),
}
"""Each consumer group of the pipeline and the topics it reads (for ``runtime.messaging.topics.group_lag``)."""


@dataclass
class Stages:
    """Latencies, error rates and widths of the stages."""

    policy_latency_ms: float = 20.0
    judge_latency_ms: float = 50.0
    teacher_latency_ms: float = 20.0
    policy_fail_every: int = 0
    policy_slow_every: int = 0
    """Every Nth policy call answers after ``slow_ms`` (set the proxy's engine timeout below it for timeouts)."""
    slow_ms: float = 2000.0
    judge_fail_every: int = 0
    teacher_fail_every: int = 0
    judge_workers: int = 1
    judge_concurrency: int = 8
    teacher_concurrency: int = 4
    mode: str = "combine"
    extra_env: dict[str, str] = field(default_factory=dict)


class Stub(ServiceProcess):
    """A stub engine script (bench/) in its own process, ready once /health answers; its output appended to
    ``log``."""

    def __init__(self, script: str, latency_ms: float, fail_every: int, log: Path, *extra: str) -> None:
        port = free_port()
        with open(log, "a") as out:
            super().__init__(
                [
                    "--port",
                    str(port),
                    "--latency-ms",
                    str(latency_ms),
                    "--fail-every",
                    str(fail_every),
                    *extra,
                ],
                port=port,
                ready_path="/health",
                log=out,
                startup_timeout_s=30,
                program=[sys.executable, str(REPO / "bench" / script)],
            )


class Pipeline:
    """Stub engines and the five services of one namespace. ``kill``/``start_service`` inject process faults."""

    def __init__(
        self,
        kafka: KafkaConfig,
        redis_url: str,
        redis_prefix: str,
        tokenizer: str,
        workdir: Path,
        stages: Stages | None = None,
    ) -> None:
        self.kafka = kafka
        self.redis_url = redis_url
        self.redis_prefix = redis_prefix
        self.tokenizer = tokenizer
        self.workdir = workdir
        self.stages = stages or Stages()
        self.stubs: dict[str, Stub] = {}
        self.procs: dict[str, ServiceProcess] = {}
        self.ports: dict[str, int] = {}
        workdir.mkdir(parents=True, exist_ok=True)

    # lifecycle ---------------------------------------------------------------------------------------------------

    def start(self) -> Pipeline:
        s = self.stages
        try:
            self.stubs["policy"] = Stub(
                "stub_engine.py",
                s.policy_latency_ms,
                s.policy_fail_every,
                self.workdir / "stub-policy.log",
                *("--slow-every", str(s.policy_slow_every), "--slow-ms", str(s.slow_ms)),
            )
            self.stubs["judge"] = Stub(
                "stub_judge.py", s.judge_latency_ms, s.judge_fail_every, self.workdir / "stub-judge.log"
            )
            self.stubs["teacher"] = Stub(
                "stub_engine.py",
                s.teacher_latency_ms,
                s.teacher_fail_every,
                self.workdir / "stub-teacher.log",
            )
            for name in self.names():
                self.start_service(name)
        except BaseException:
            self.stop()
            raise
        return self

    def names(self) -> list[str]:
        judges = [f"judge{i + 1}" if i else "judge" for i in range(self.stages.judge_workers)]
        return ["proxy", "pairer", *judges, "teacher", "dispatcher"]

    @property
    def proxy_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['proxy']}"

    def env(self) -> dict[str, str]:
        s = self.stages
        return {
            **self.kafka.client_env(),
            "TURNSTREAM_KAFKA_POLL_TIMEOUT_MS": "100",
            "TURNSTREAM_KAFKA_SESSION_TIMEOUT_MS": "6000",
            "TURNSTREAM_KAFKA_HEARTBEAT_INTERVAL_MS": "500",
            "TURNSTREAM_REDIS_URL": self.redis_url,
            "TURNSTREAM_REDIS_KEY_PREFIX": self.redis_prefix,
            "TURNSTREAM_ENGINE_URL": self.stubs["policy"].url,
            "TURNSTREAM_ENGINE_RETRIES": "0",
            "TURNSTREAM_PROXY_SPOOL_DIR": str(self.workdir / "spool"),
            "TURNSTREAM_PROXY_WEIGHTS_ROOT": str(self.workdir),
            "TURNSTREAM_PROXY_RELOAD": "false",
            "TURNSTREAM_JUDGE_JUDGE_ID": JUDGE_ID,
            "TURNSTREAM_JUDGE_BACKEND": "engine",
            "TURNSTREAM_JUDGE_ENGINE_URL": self.stubs["judge"].url,
            "TURNSTREAM_JUDGE_MODEL": "stub-judge",
            "TURNSTREAM_JUDGE_MAX_CONCURRENCY": str(s.judge_concurrency),
            "TURNSTREAM_JUDGE_DEADLINE_S": "600",
            "TURNSTREAM_TEACHER_ENGINE_URL": self.stubs["teacher"].url,
            "TURNSTREAM_TEACHER_MODEL": "stub-teacher",
            "TURNSTREAM_TEACHER_TOKENIZER": self.tokenizer,
            "TURNSTREAM_TEACHER_MAX_CONCURRENCY": str(s.teacher_concurrency),
            "TURNSTREAM_TEACHER_DEADLINE_S": "600",
            "TURNSTREAM_DISPATCHER_MODE": s.mode,
            "TURNSTREAM_DISPATCHER_JUDGE_IDS": JUDGE_ID,
            "TURNSTREAM_LOGGING_LEVEL": "INFO",
            "OMP_NUM_THREADS": "1",
            **s.extra_env,
        }

    def start_service(self, name: str, env_overrides: dict[str, str] | None = None) -> None:
        port = self.ports.setdefault(name, free_port())
        env = {**self.env(), **(env_overrides or {})}
        if name == "proxy":
            args, ready = ["proxy", "--port", str(port)], "/healthz"
        else:
            args, ready = [name.rstrip("0123456789")], "/metrics"
            env["TURNSTREAM_METRICS_PORT"] = str(port)
        log = open(self.workdir / f"{name}.log", "a")
        try:
            self.procs[name] = ServiceProcess(args, port=port, ready_path=ready, env=env, log=log)
        finally:
            log.close()

    def stop_service(self, name: str) -> None:
        """SIGTERM: the service finishes what it holds and exits."""
        self.procs.pop(name).stop()

    def kill(self, name: str) -> None:
        """``kill -9``: no flush, no commit, no goodbye."""
        proc = self.procs.pop(name).proc
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)

    def stop(self) -> None:
        for proc in self.procs.values():
            proc.stop()
        self.procs.clear()
        for stub in self.stubs.values():
            stub.stop()
        self.stubs.clear()


# synthetic sessions -----------------------------------------------------------------------------------------------


def corrected(session: int, turn: int) -> bool:
    """Whether the user's message after ``turn`` says the answer was wrong (one turn in three)."""
    return (session * 7 + turn) % 3 == 0


def user_message(session: int, turn: int) -> str:
    """The user's k-th message, tagged ``[turn k]`` so a recorded turn says which request it answered."""
    if turn == 1:
        text = f"Session {session}: how do I configure the exporter?"
    elif corrected(session, turn - 1):
        text = "That's wrong, the exporter flag is different. Try again."
    else:
        text = "Thanks, that worked."
    return f"{text} [turn {turn}]"


def request_of(turn: Turn) -> tuple[str, int] | None:
    """(session id, k) of the synthetic request a recorded turn answered."""
    text = turn.messages[-1].text if turn.messages else ""
    m = _TAG.search(text)
    return (turn.session_id, int(m.group(1))) if m else None


_TAG = re.compile(r"\[turn (\d+)\]$")


@dataclass
class Driven:
    """What the synthetic users saw."""

    answered: set[tuple[str, int]] = field(default_factory=set)
    """(session id, k) of every request answered with 200."""
    next_state_at: dict[tuple[str, int], float] = field(default_factory=dict)
    """(session id, k) -> wall time its next state (request k+1) reached the proxy."""
    retries: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    started_at: float = 0.0
    ended_at: float = 0.0


async def drive(
    proxy_url: str,
    sessions: int,
    turns: int,
    concurrency: int,
    prefix: str,
    *,
    retry_for_s: float = 120.0,
    progress: Callable[[], None] | None = None,
) -> Driven:
    """``sessions`` sessions of ``turns`` turns, ``concurrency`` sessions at a time, each request retried (as a
    client would) until it is answered."""
    out = Driven(started_at=time.time())
    queue: asyncio.Queue[int] = asyncio.Queue()
    for s in range(sessions):
        queue.put_nowait(s)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=proxy_url, timeout=30, limits=limits) as http:

        async def send(body: dict[str, Any], headers: dict[str, str]) -> dict[str, Any]:
            deadline = time.monotonic() + retry_for_s
            while True:
                try:
                    r = await http.post("/v1/chat/completions", json=body, headers=headers)
                    if r.status_code == 200:
                        return r.json()  # type: ignore[no-any-return]
                    out.errors[str(r.status_code)] += 1
                except httpx.HTTPError as exc:
                    out.errors[type(exc).__name__] += 1
                if time.monotonic() > deadline:
                    raise RuntimeError(f"no answer for {headers} within {retry_for_s} s")
                out.retries += 1
                await asyncio.sleep(0.2)

        async def user() -> None:
            while not queue.empty():
                s = queue.get_nowait()
                sid = session_id(prefix, s)
                messages: list[dict[str, Any]] = [
                    {"role": "system", "content": "You are a helpful assistant."}
                ]
                for k in range(1, turns + 1):
                    messages.append({"role": "user", "content": user_message(s, k)})
                    headers = {"X-Session-Id": sid}
                    if k == turns:
                        headers["X-Session-Done"] = "true"
                    if k > 1:
                        out.next_state_at[(sid, k - 1)] = time.time()
                    reply = await send({"model": "policy", "messages": messages, "max_tokens": 60}, headers)
                    out.answered.add((sid, k))
                    if progress is not None:
                        progress()
                    messages.append(
                        {"role": "assistant", "content": reply["choices"][0]["message"]["content"]}
                    )

        await asyncio.gather(*(user() for _ in range(concurrency)))
    out.ended_at = time.time()
    return out


def session_id(prefix: str, session: int) -> str:
    return f"{prefix}{session}"


# the account ------------------------------------------------------------------------------------------------------


@dataclass
class Topics:
    turns: list[Turn]
    paired: list[PairedTurn]
    judgments: list[Judgment]
    teacher: list[TeacherScores]
    samples: list[Sample]
    weights: list[WeightsPublished]
    dead_letters: list[DeadLetter]


async def read_all(kafka: KafkaConfig) -> Topics:
    async def events(spec: Any) -> list[Any]:
        return [r.event async for r in read_topic(kafka, spec, skip_undecodable=True)]

    return Topics(
        turns=await events(TURNS),
        paired=await events(TURNS_PAIRED),
        judgments=await events(JUDGMENTS),
        teacher=await events(TEACHER),
        samples=await events(SAMPLES),
        weights=await events(WEIGHTS),
        dead_letters=await events(DEADLETTER),
    )


OUTPUTS = ("paired", "judgments", "teacher", "samples")


@dataclass
class Account:
    """Per topic: records expected and found, and the turn ids missing or duplicated.

    Expected, per recorded turn: one pairing; for a turn that is not its session's last, an eval and a hint
    judgment and one sample (combine mode), and teacher scores when the next state was a correction. Found counts
    distinct keys (docs/design.md, Delivery guarantees: turn id; turn id/judge id/kind; turn id/judge id; sample
    id): delivery is at-least-once, so a key seen twice on an intermediate topic is a redelivery, harmless by
    design and reported apart. A sample is what gets trained: two with one sample id are a duplicate, as is a
    second turn id for one answered request."""

    expected: dict[str, int]
    found: dict[str, int]
    missing: dict[str, list[str]]
    duplicated: dict[str, list[str]]
    redelivered: dict[str, int]
    recorded_unanswered: list[str]
    """Turns the engine produced and the proxy recorded whose answer never reached the user (the proxy died in
    between, the user retried): real turns, which flow through like the others."""

    @property
    def exact(self) -> bool:
        return not any(self.missing.values()) and not any(self.duplicated.values())

    def summary(self) -> dict[str, Any]:
        return {
            "expected": self.expected,
            "found": self.found,
            "missing": {k: len(v) for k, v in self.missing.items()},
            "duplicated": {k: len(v) for k, v in self.duplicated.items()},
            "redelivered": self.redelivered,
            "recorded_but_never_answered": len(self.recorded_unanswered),
        }


def account(topics: Topics, driven: Driven, prefix: str) -> Account:
    turns: dict[str, Turn] = {}
    duplicated: dict[str, list[str]] = {k: [] for k in ("turns", *OUTPUTS)}
    missing: dict[str, list[str]] = {k: [] for k in ("turns", *OUTPUTS)}
    redelivered = dict.fromkeys(("turns", *OUTPUTS), 0)
    for t in topics.turns:
        if t.session_id.startswith(prefix):
            if t.turn_id in turns:
                redelivered["turns"] += 1
            turns[t.turn_id] = t
    by_request: dict[tuple[str, int], list[Turn]] = {}
    for t in turns.values():
        key = request_of(t)
        if key is not None:
            by_request.setdefault(key, []).append(t)
    missing["turns"] = [f"{sid}:[turn {k}]" for sid, k in sorted(driven.answered - set(by_request))]
    # A request answered twice (the first answer lost with a killed proxy, the user retried): the retry's turn is
    # the one in the user's history; the earlier one was produced too and is accounted as unanswered.
    unanswered = [
        t.turn_id for ts in by_request.values() for t in sorted(ts, key=lambda t: t.turn_index)[:-1]
    ]
    unanswered += [t.turn_id for key, ts in by_request.items() if key not in driven.answered for t in ts[-1:]]
    want: dict[str, dict[str, int | None]] = {}
    for tid, t in turns.items():
        key = request_of(t)
        if t.session_done:
            want[tid] = {"paired": 1, "judgments": 0, "teacher": 0, "samples": 0}
        elif key is None or tid in unanswered:  # its next state is whatever came next: teacher depends on it
            want[tid] = {"paired": 1, "judgments": 2, "teacher": None, "samples": 1}
        else:
            wrong = corrected(int(key[0][len(prefix) :]), key[1])
            want[tid] = {"paired": 1, "judgments": 2, "teacher": int(wrong), "samples": 1}
    keys: dict[str, list[tuple[str, str]]] = {
        "paired": [(p.turn.turn_id, "") for p in topics.paired],
        "judgments": [(j.turn_id, f"{j.judge_id}/{j.kind}") for j in topics.judgments],
        "teacher": [(s.turn_id, s.judge_id) for s in topics.teacher],
        "samples": [(s.sample_id, "") for s in topics.samples],
    }
    found: dict[str, int] = {"turns": len(turns)}
    for topic, ks in keys.items():
        ks = [k for k in ks if k[0] in want]
        copies = Counter(ks)
        redelivered[topic] = sum(n - 1 for n in copies.values())
        if topic == "samples":
            duplicated[topic] = sorted(tid for (tid, _), n in copies.items() if n > 1)
        per_turn = Counter(tid for tid, _ in copies)
        found[topic] = len(copies)
        for tid, w in want.items():
            n, expect = per_turn.get(tid, 0), w[topic]
            if expect is None:
                if n > 1:
                    duplicated[topic].append(tid)
            elif n < expect:
                missing[topic].append(tid)
            elif n > expect:
                duplicated[topic].append(tid)
    return Account(
        expected={
            "turns": len(driven.answered),
            **{k: sum(w[k] or 0 for w in want.values()) for k in OUTPUTS},
        },
        found=found,
        missing=missing,
        duplicated=duplicated,
        redelivered=redelivered,
        recorded_unanswered=sorted(unanswered),
    )

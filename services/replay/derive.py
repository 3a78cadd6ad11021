"""``turnstream replay derive``: pairing, judging, teacher scoring and dispatch run again over recorded turns, into
a new topic namespace, with another mode, judge or prompt; the live topics are only read.

The chosen turns are copied to ``<into>turns``; then the pairer, judge, teacher (modes opd and combine) and
dispatcher run as processes with ``kafka.namespace = <into>`` and a Redis key prefix of their own, so their
consumer groups and state never touch the live pipeline's. The replay is finished when every stage has committed
everything in its input topics and the pairer holds no open session (sessions without a done mark end after
``--idle-timeout``, counted from their last turn, exactly as live), then the services are stopped and the new
namespace's contents are counted.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections import Counter
from pathlib import Path

import msgspec

from runtime.configuration.config import Config
from runtime.engine.model_store import cache_dir
from runtime.messaging.bus import EventProducer, read_topic
from runtime.messaging.topics import create_topics, group_lag, pipeline_groups
from runtime.process.ports import free_port_block
from runtime.process.supervisor import Service, StartupFailed, Supervisor
from runtime.transport.redis_urls import redis_client
from schemas.modes import mode_spec
from schemas.topics import DEADLETTER, JUDGMENTS, SAMPLES, SESSIONS_ENDED, TEACHER, TURNS_PAIRED
from services.replay.select import Range, publish_turns, recorded_session_ends, recorded_turns

log = logging.getLogger("turnstream.replay")


class DeriveOptions(msgspec.Struct, kw_only=True):
    into: str
    """The new namespace (must differ from the source's)."""
    span: Range = msgspec.field(default_factory=Range)
    mode: str | None = None
    judge_backend: str | None = None
    judge_engine_url: str | None = None
    judge_model: str | None = None
    judge_prompts: str | None = None
    judge_id: str | None = None
    teacher_engine_url: str | None = None
    idle_timeout_s: float | None = None
    run_dir: str = ""
    timeout_s: float = 3600.0


class DeriveSummary(msgspec.Struct):
    namespace: str
    copied_turns: int
    paired: int
    judgments: int
    teacher_scores: int
    samples: dict[str, int]
    deadletters: int
    seconds: float


class DeriveFailed(RuntimeError):
    pass


def derive_config(config: Config, opts: DeriveOptions) -> Config:
    """The replay's configuration: the source's, in the new namespace, with the requested changes."""
    kafka = config.kafka.in_namespace(opts.into)
    replace = msgspec.structs.replace
    judge = config.judge
    for field, value in (
        ("backend", opts.judge_backend),
        ("engine_url", opts.judge_engine_url),
        ("model", opts.judge_model),
        ("prompts_dir", opts.judge_prompts),
        ("judge_id", opts.judge_id),
    ):
        if value is not None:
            judge = replace(judge, **{field: value})
    dispatcher = config.dispatcher
    if opts.mode is not None:
        mode_spec(opts.mode)  # an unknown mode stops the replay here, naming the known ones
        dispatcher = replace(dispatcher, mode=opts.mode)
    if opts.judge_id is not None:
        dispatcher = replace(dispatcher, judge_ids=[opts.judge_id])
    teacher = config.teacher
    if opts.teacher_engine_url is not None:
        teacher = replace(teacher, engine_url=opts.teacher_engine_url)
    pairer = config.pairer
    if opts.idle_timeout_s is not None:
        pairer = replace(pairer, idle_timeout_s=opts.idle_timeout_s)
    return replace(
        config,
        kafka=kafka,
        redis=replace(config.redis, key_prefix=f"{config.redis.key_prefix}{kafka.namespace}"),
        judge=judge,
        dispatcher=dispatcher,
        teacher=teacher,
        pairer=pairer,
    )


def stages(replay: Config, config_path: str | None) -> list[Service]:
    """The services of the replay: one process each, configured through TURNSTREAM_* variables."""
    names = ["pairer", "judge", "dispatcher"]
    if mode_spec(replay.dispatcher.mode).needs_hint:  # the teacher scores accepted hints
        names.insert(2, "teacher")
    base = free_port_block(len(names))
    j, t, d = replay.judge, replay.teacher, replay.dispatcher
    env = {
        "TURNSTREAM_KAFKA_NAMESPACE": replay.kafka.namespace,
        "TURNSTREAM_REDIS_KEY_PREFIX": replay.redis.key_prefix,
        "TURNSTREAM_PAIRER_IDLE_TIMEOUT_S": str(replay.pairer.idle_timeout_s),
        "TURNSTREAM_JUDGE_JUDGE_ID": j.judge_id,
        "TURNSTREAM_JUDGE_BACKEND": j.backend,
        "TURNSTREAM_JUDGE_ENGINE_URL": j.engine_url,
        "TURNSTREAM_JUDGE_MODEL": j.model,
        "TURNSTREAM_JUDGE_PROMPTS_DIR": j.prompts_dir,
        "TURNSTREAM_TEACHER_ENGINE_URL": t.engine_url,
        "TURNSTREAM_DISPATCHER_MODE": d.mode,
        "TURNSTREAM_DISPATCHER_JUDGE_IDS": ",".join(d.judge_ids),
    }
    args = ["--config", config_path] if config_path else []
    return [
        Service(
            name, [*args, name], {**env, "TURNSTREAM_METRICS_PORT": str(base + i)}, base + i, "/metrics", 0
        )
        for i, name in enumerate(names)
    ]


async def _open_sessions(replay: Config) -> int:
    redis = redis_client(replay.redis.url)
    try:
        return int(await redis.zcard(replay.redis.pairer_idle_key))
    finally:
        await redis.aclose()


async def copy_turns(source: Config, replay: Config, span: Range) -> int:
    """The span's turns, and the session ends among them (the pairer reads both), into the replay namespace."""
    async with EventProducer(replay.kafka, client_id=f"{replay.kafka.client_id}-replay") as producer:
        copied = await publish_turns(
            producer, (rec.event async for rec in recorded_turns(source.kafka, span))
        )
        async for ended in recorded_session_ends(source.kafka, span):
            await producer.send(SESSIONS_ENDED, ended, ended.session_id)
        return copied


async def derive(config: Config, opts: DeriveOptions, config_path: str | None = None) -> DeriveSummary:
    started = time.monotonic()
    replay = derive_config(config, opts)
    if replay.kafka.namespace == config.kafka.namespace:
        raise DeriveFailed("--into must name a namespace other than the source's: a replay never writes live")
    await create_topics(replay.kafka)
    copied = await copy_turns(config, replay, opts.span)
    _say(f"copied {copied} turns into {replay.kafka.namespace}turns")
    run_dir = (
        Path(opts.run_dir) if opts.run_dir else cache_dir() / "replay" / replay.kafka.namespace.rstrip(".")
    )
    await asyncio.to_thread(run_dir.mkdir, parents=True, exist_ok=True)
    supervisor = Supervisor(stages(replay, config_path), run_dir, startup_timeout_s=300)
    try:
        try:
            await asyncio.to_thread(supervisor.start)
        except StartupFailed as exc:
            raise DeriveFailed(str(exc)) from None
        _say(f"running {', '.join(s.name for s in supervisor.services)} (logs in {run_dir})")
        await _until_finished(replay, supervisor, started + opts.timeout_s)
    finally:
        await asyncio.to_thread(supervisor.stop)
    return await summarize(replay, copied, time.monotonic() - started)


async def _until_finished(replay: Config, supervisor: Supervisor, deadline: float) -> None:
    groups = pipeline_groups(replay)
    quiet = 0
    while quiet < 2:  # twice in a row: a stage may be between committing and producing
        if dead := supervisor.dead():
            raise DeriveFailed(
                f"{dead[0][0]} exited with {dead[0][1]}; see {supervisor.log_path(dead[0][0])}"
            )
        if time.monotonic() > deadline:
            raise DeriveFailed("the replay did not finish in time")
        lag = await group_lag(replay.kafka, groups)
        open_sessions = await _open_sessions(replay)
        _say(f"behind: {sum(lag.values())} records ({', '.join(f'{g}={n}' for g, n in lag.items())}); "
             f"open sessions: {open_sessions}")  # fmt: skip
        quiet = quiet + 1 if not any(lag.values()) and not open_sessions else 0
        await asyncio.sleep(1.0)


async def summarize(replay: Config, copied: int, seconds: float) -> DeriveSummary:
    async def count(spec) -> int:  # type: ignore[no-untyped-def]
        return sum([1 async for _ in read_topic(replay.kafka, spec)])

    kinds = Counter([rec.event.kind async for rec in read_topic(replay.kafka, SAMPLES)])
    return DeriveSummary(
        namespace=replay.kafka.namespace,
        copied_turns=copied,
        paired=await count(TURNS_PAIRED),
        judgments=await count(JUDGMENTS),
        teacher_scores=await count(TEACHER),
        samples=dict(kinds),
        deadletters=await count(DEADLETTER),
        seconds=round(seconds, 1),
    )


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)

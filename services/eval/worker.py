"""``turnstream eval``: the held-out evaluation of every weight version the policy engine serves.

Whenever the engine (``eval.engine_url``, default the policy's) serves a version that has no result yet for the
held-out set, the held-out questions go straight to the engine (not through the proxy: they must never become
training traffic), greedy, and each answer is scored by every persona's check; one ``EvalResult`` per version goes
to ``evals``. While it runs, the proxy's reloader holds the next version back (``eval.hold_reload_s``), so each
version served is evaluated even when versions come faster than an evaluation takes. Every answer must come from
that version (the engine reports which version made each token): if the engine moved on anyway (the hold expired,
no Redis, another proxy without it) the result is discarded and the newer version evaluated instead. Versions
the engine passed over before they could be evaluated are counted, not guessed. The versions already evaluated
are read back from ``evals`` at start, so a restart evaluates none twice. The evaluation sets of ``eval.sets``
(``runtime/pipeline/evalsets.py``) are scored for the same version under the same hold, and go to ``evals`` before its
held-out result (the held-out result marks the version done).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import AsyncIterator, Sequence

from prometheus_client import Counter, Gauge, Histogram
from redis.exceptions import RedisError

from runtime.configuration.config import Config, RedisConfig
from runtime.engine.client import EngineClient, EngineError, adapter_name, close_engine_pool, weight_versions
from runtime.messaging.bus import EventProducer, read_topic
from runtime.observability.metrics import serve_metrics
from runtime.pipeline.evalsets import Rubric, load_set
from runtime.pipeline.personas import Persona, by_name, heldout_questions
from runtime.transport.redis_urls import redis_client
from schemas import EvalAnswer, EvalResult
from schemas.topics import EVALS
from services.eval import asking
from services.eval.heldout import judged, question_set_id, result
from services.eval.set_runner import SetRunError, engine_asker, engine_rubric, judge_client, run_set

log = logging.getLogger("turnstream.eval")

RESULTS = Counter("turnstream_eval_results_total", "Weight versions evaluated on the held-out set")
SCORE = Gauge(
    "turnstream_eval_score", "Held-out share of answers meeting the persona's preference", ["persona"]
)
VERSION = Gauge("turnstream_eval_version", "Newest weight version evaluated")
SKIPPED = Counter(
    "turnstream_eval_skipped_versions_total", "Versions the engine served too briefly to evaluate"
)
DISCARDED = Counter("turnstream_eval_discarded_total", "Evaluations discarded", ["reason"])
SECONDS = Histogram(
    "turnstream_eval_seconds", "One version's held-out evaluation", buckets=(1, 5, 15, 30, 60, 120, 300, 900)
)


class Evaluator:
    """Asks one policy engine, or the first of several replicas (``engine.replicas``) that answers: every replica
    serves the versions the reloader gives them, so a version is evaluated on whichever replica serves it, and a
    replica that is down does not stop the evaluation."""

    def __init__(
        self,
        engine: EngineClient | Sequence[EngineClient],
        personas: tuple[Persona, ...],
        questions: list[str],
        max_tokens: int,
        concurrency: int,
        adapters: bool = False,
        thinking: bool = False,
    ) -> None:
        self.engines = [engine] if isinstance(engine, EngineClient) else list(engine)
        if not self.engines:
            raise ValueError("no policy engine to evaluate on")
        self.engine = self.engines[0]
        """The engine that answered ``served`` last: the evaluation that follows asks it."""
        self.thinking = thinking
        self.adapters = adapters
        """Versions are LoRA adapters on the engine's base (``Config.lora_adapters``): the newest loaded one is
        the served version, and answers name it."""
        self.personas = personas
        self.questions = questions
        self.max_tokens = max_tokens
        self.limit = asyncio.Semaphore(concurrency)

    async def served(self) -> tuple[int, str] | None:
        """(version, model) the engine serves now (the one that answered last first, then the other replicas in
        order); None when none answers or it reports no integer version."""
        for engine in sorted(self.engines, key=lambda e: e is not self.engine):
            try:
                info = await engine.model_info()
            except EngineError as exc:
                log.warning("engine unavailable", extra={"engine": engine.base_url, "error": str(exc)})
                continue
            self.engine = engine
            return await self._version(info)
        return None

    async def _version(self, info: dict[str, object]) -> tuple[int, str] | None:
        version = str(info.get("weight_version", ""))
        if not version.isdigit():
            return None
        model = str(info.get("served_model_name") or info.get("model_path") or "default")
        if self.adapters:
            try:
                return max(await self.engine.adapter_versions(), default=0), model
            except EngineError as exc:
                log.warning("engine unavailable", extra={"error": str(exc)})
                return None
        return int(version), model

    async def answer(self, question: str, version: int, model: str) -> EvalAnswer | None:
        """The greedy answer of ``version`` (None: another version answered)."""
        body = asking.request(model, [{"role": "user", "content": question}], self.max_tokens, self.thinking)
        if self.adapters and version:
            body["lora_path"] = adapter_name(version)
        async with self.limit:  # greedy: a retried request gets the same answer
            data = await self.engine.chat_raw(body, idempotent=True)
        # With adapters the engine's own version is the base's (0), and the adapter is the one named.
        if weight_versions(data) != ({0} if self.adapters else {version}):
            return None
        text = asking.answer_text(data)
        tokens = int((data.get("usage") or {}).get("completion_tokens", 0))
        return judged(question, text, self.personas, tokens)

    async def evaluate(self, version: int, model: str) -> EvalResult | None:
        started = time.monotonic()
        answers = await asyncio.gather(*(self.answer(q, version, model) for q in self.questions))
        if any(a is None for a in answers):
            DISCARDED.labels("version_changed").inc()
            log.info("the engine moved on during the evaluation; discarded", extra={"version": version})
            return None
        done = [a for a in answers if a is not None]
        evaluated = result(version, self.questions, done, self.personas, model, started)
        SECONDS.observe(evaluated.duration_s)
        return evaluated


class ReloadHold:
    """Asks the proxy's reloader to keep the evaluated version served until its evaluation ends (a Redis key with
    an expiry, ``RedisConfig.eval_hold_key``). Without Redis the evaluation runs unheld (and may be discarded)."""

    def __init__(self, redis: RedisConfig, hold_s: float) -> None:
        self.redis = redis
        self.hold_ms = int(hold_s * 1000)
        self.client = redis_client(redis.url) if self.hold_ms > 0 else None

    @contextlib.asynccontextmanager
    async def reloads(self, version: int) -> AsyncIterator[None]:
        key = self.redis.eval_hold_key(version)
        held = False
        if self.client is not None:
            try:
                held = bool(await self.client.set(key, b"1", px=self.hold_ms))
            except (RedisError, OSError) as exc:
                log.warning("could not hold reloads; evaluating anyway", extra={"error": str(exc)})
        try:
            yield
        finally:
            if held and self.client is not None:
                with contextlib.suppress(RedisError, OSError):
                    await self.client.delete(key)

    async def aclose(self) -> None:
        if self.client is not None:
            await self.client.aclose()


async def evaluated_versions(config: Config, question_set: str) -> set[int]:
    return {
        r.event.version async for r in read_topic(config.kafka, EVALS) if r.event.question_set == question_set
    }


async def run_eval(
    config: Config, *, install_signals: bool = True, stop: asyncio.Event | None = None
) -> None:
    """Until SIGTERM/SIGINT or ``stop``: evaluate each newly served version once."""
    ec = config.eval
    questions = heldout_questions()
    personas = by_name(ec.personas or None)
    engines = [
        EngineClient(url, api_key=config.engine.api_key, timeout_s=config.engine.timeout_s)
        for url in ([ec.engine_url] if ec.engine_url else config.engine.urls)
    ]
    evaluator = Evaluator(
        engines, personas, questions, ec.max_tokens, ec.concurrency, config.lora_adapters, ec.thinking
    )
    stop = stop or asyncio.Event()
    if install_signals:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
    serve_metrics(config.metrics.port, config.metrics.host)
    sets = [load_set(path) for path in ec.sets]  # a bad file stops the start, naming its line
    if any(c.rubric is not None for s in sets for case in s.cases for c in case.checks):
        judge, judge_model = judge_client(config)
        rubric: Rubric | None = engine_rubric(judge, judge_model)
    else:
        rubric = None
    ask = engine_asker(
        lambda: evaluator.engine, ec.max_tokens, config.lora_adapters, ec.concurrency, ec.thinking
    )
    question_set = question_set_id(questions)
    done = await evaluated_versions(config, question_set)
    last = max(done, default=-1)
    log.info("eval running", extra={"question_set": question_set, "evaluated": sorted(done)[-5:]})
    hold = ReloadHold(config.redis, ec.hold_reload_s)
    async with EventProducer(config.kafka, client_id=f"{config.kafka.client_id}-eval") as producer:
        try:
            while not stop.is_set():
                now = await evaluator.served()
                if now is not None and now[0] not in done:
                    version, model = now
                    async with hold.reloads(version):
                        # A reload may have begun before the hold was set: then evaluate the version it brings.
                        if await evaluator.served() != now:
                            continue
                        evaluated = await evaluator.evaluate(version, model)
                        scored_sets = []
                        if evaluated is not None:
                            try:
                                scored_sets = [await run_set(s, version, model, ask, rubric) for s in sets]
                            except SetRunError as exc:
                                DISCARDED.labels("version_changed").inc()
                                log.info(
                                    "an evaluation set was not scored; discarded", extra={"error": str(exc)}
                                )
                                evaluated = None
                    if evaluated is not None:
                        for scored_set in scored_sets:
                            await producer.send(EVALS, scored_set, str(version))
                        await producer.send(EVALS, evaluated, str(version))
                        if last >= 0 and version > last + 1:
                            SKIPPED.inc(version - last - 1)
                        done.add(version)
                        last = max(last, version)
                        RESULTS.inc()
                        VERSION.set(version)
                        for name, score in evaluated.scores.items():
                            SCORE.labels(name).set(score)
                        log.info("version evaluated", extra={"version": version, "scores": evaluated.scores})
                        continue
                try:
                    await asyncio.wait_for(stop.wait(), ec.poll_s)
                except TimeoutError:
                    pass
        finally:
            await hold.aclose()
            await close_engine_pool()

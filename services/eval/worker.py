"""``turnstream eval``: the held-out evaluation of every weight version the policy engine serves.

Whenever the engine (``eval.engine_url``, default the policy's) serves a version that has no result yet for the
held-out set, the held-out questions go straight to the engine (not through the proxy: they must never become
training traffic), greedy, and each answer is scored by every persona's check; one ``EvalResult`` per version goes
to ``evals``. Every answer must come from that version (the engine reports which version produced a response): if
the engine moved on mid-evaluation the result is discarded and the newer version evaluated instead. Versions the
engine passed over before they could be evaluated (a reloader that skips to the newest) are counted, not
guessed. The versions already evaluated are read back from ``evals`` at start, so a restart evaluates none twice.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time

from prometheus_client import Counter, Gauge, Histogram

from schemas import EvalAnswer, EvalResult
from schemas.topics import EVALS
from services.bus import EventProducer, read_topic
from services.config import Config
from services.engine_client import EngineClient, EngineError, close_engine_pool
from services.eval.heldout import judged, question_set_id, result
from services.metrics import serve_metrics
from services.personas import Persona, by_name, heldout_questions

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
    def __init__(
        self,
        engine: EngineClient,
        personas: tuple[Persona, ...],
        questions: list[str],
        max_tokens: int,
        concurrency: int,
    ) -> None:
        self.engine = engine
        self.personas = personas
        self.questions = questions
        self.max_tokens = max_tokens
        self.limit = asyncio.Semaphore(concurrency)

    async def served(self) -> tuple[int, str] | None:
        """(version, model) the engine serves now; None when it does not answer or reports no integer version."""
        try:
            info = await self.engine.model_info()
        except EngineError as exc:
            log.warning("engine unavailable", extra={"error": str(exc)})
            return None
        version = str(info.get("weight_version", ""))
        if not version.isdigit():
            return None
        return int(version), str(info.get("served_model_name") or info.get("model_path") or "default")

    async def answer(self, question: str, version: int, model: str) -> EvalAnswer | None:
        """The greedy answer of ``version`` (None: another version answered)."""
        body = {
            "model": model,
            "messages": [{"role": "user", "content": question}],
            "max_tokens": self.max_tokens,
            "temperature": 0,
        }
        async with self.limit:
            reply = await self.engine.chat(body)
        if reply.weight_version is not None and reply.weight_version != str(version):
            return None
        text = str(reply.message.get("content") or "").strip()
        tokens = int((reply.raw.get("usage") or {}).get("completion_tokens", 0))
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
    engine = EngineClient(
        ec.engine_url or config.engine.url, api_key=config.engine.api_key, timeout_s=config.engine.timeout_s
    )
    evaluator = Evaluator(engine, personas, questions, ec.max_tokens, ec.concurrency)
    stop = stop or asyncio.Event()
    if install_signals:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
    serve_metrics(config.metrics.port, config.metrics.host)
    question_set = question_set_id(questions)
    done = await evaluated_versions(config, question_set)
    last = max(done, default=-1)
    log.info("eval running", extra={"question_set": question_set, "evaluated": sorted(done)[-5:]})
    async with EventProducer(config.kafka, client_id=f"{config.kafka.client_id}-eval") as producer:
        try:
            while not stop.is_set():
                now = await evaluator.served()
                if now is not None and now[0] not in done:
                    version, model = now
                    evaluated = await evaluator.evaluate(version, model)
                    if evaluated is not None:
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
            await close_engine_pool()

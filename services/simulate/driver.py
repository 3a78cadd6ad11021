"""``turnstream simulate``: simulated users talking to the proxy like real ones, and what they show about learning.

Each user runs sessions back to back: a persona and a question from the bundled set, then for a few turns the
persona's reaction (a correction when the preference is violated, thanks and a new question when it is met). A share
of the sessions (``--stock-share``, half by default) is sent as a stock client sends it: no session headers, only the
conversation so far, so the proxy's conversation continuity has to find the session; the others carry OpenClaw-RL's
headers, their final reaction sent with ``X-Session-Done`` so that every judged turn has its next state (a stock
session's last turn closes when it goes idle). Every response is observed with the weight version that produced it
(``metadata.weight_version``), and ``<out>/summary.json`` and ``<out>/learning.png`` show, per version, how often the
preference was met and how long the responses were.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
import time
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Any

import httpx
import msgspec
from prometheus_client import Counter

from runtime.pipeline.personas import Persona, questions

log = logging.getLogger("turnstream.simulate")

FAILED = Counter("turnstream_simulate_failed_requests_total", "Simulated requests that failed (retried)")
RESPONSES = Counter(
    "turnstream_simulate_responses_total", "Responses seen by simulated users", ["persona", "met"]
)


def user(text: str) -> dict[str, Any]:
    """A user message as the OpenClaw app sends it: content as a list of OpenAI content parts."""
    return {"role": "user", "content": [{"type": "text", "text": text}]}


class Observation(msgspec.Struct):
    session_id: str
    turn: int
    persona: str
    weight_version: int
    satisfied: bool
    words: int
    completion_tokens: int
    at: float


class VersionStats(msgspec.Struct):
    weight_version: int
    responses: int
    satisfaction: float
    mean_words: float
    mean_completion_tokens: float
    by_persona: dict[str, float]
    """Satisfaction rate per persona."""


class Summary(msgspec.Struct):
    responses: int
    sessions: int
    failed_requests: int
    wall_s: float
    versions: list[VersionStats]
    first: VersionStats | None
    last: VersionStats | None


def summarize(observations: list[Observation], sessions: int, failed: int, wall_s: float) -> Summary:
    groups: dict[int, list[Observation]] = defaultdict(list)
    for o in observations:
        groups[o.weight_version].append(o)
    versions = []
    for version in sorted(groups):
        obs = groups[version]
        personas: dict[str, list[bool]] = defaultdict(list)
        for o in obs:
            personas[o.persona].append(o.satisfied)
        versions.append(
            VersionStats(
                weight_version=version,
                responses=len(obs),
                satisfaction=sum(o.satisfied for o in obs) / len(obs),
                mean_words=sum(o.words for o in obs) / len(obs),
                mean_completion_tokens=sum(o.completion_tokens for o in obs) / len(obs),
                by_persona={k: sum(v) / len(v) for k, v in sorted(personas.items())},
            )
        )
    return Summary(
        responses=len(observations),
        sessions=sessions,
        failed_requests=failed,
        wall_s=wall_s,
        versions=versions,
        first=versions[0] if versions else None,
        last=versions[-1] if versions else None,
    )


def plot(summary: Summary, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    xs = [v.weight_version for v in summary.versions]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    top.plot(xs, [100 * v.satisfaction for v in summary.versions], marker="o", label="all personas")
    for name in sorted({p for v in summary.versions for p in v.by_persona}):
        top.plot(xs, [100 * v.by_persona.get(name, float("nan")) for v in summary.versions], "--", label=name)
    top.set_ylabel("preference met (%)")
    top.set_ylim(-5, 105)
    top.legend(loc="best", fontsize=8)
    bottom.plot(xs, [v.mean_completion_tokens for v in summary.versions], marker="o", color="tab:red")
    bottom.set_ylabel("mean response tokens")
    bottom.set_xlabel("policy weight version")
    bottom.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.suptitle(f"turnstream simulated users: {summary.responses} responses, {summary.sessions} sessions")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


class Simulator:
    def __init__(
        self,
        proxy_url: str,
        personas: tuple[Persona, ...],
        *,
        turns: int = 3,
        max_tokens: int = 64,
        temperature: float = 0.7,
        seed: int = 0,
        api_key: str | None = None,
        out_dir: Path | None = None,
        write_every_s: float = 30.0,
        stock_share: float = 0.5,
    ) -> None:
        self.stock_share = stock_share
        self.url = proxy_url.rstrip("/") + "/chat/completions"
        self.personas = personas
        self.turns = turns
        self.max_tokens = max_tokens
        self.temperature = temperature
        self.rng = random.Random(seed)
        self.questions = questions()
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.out_dir = out_dir
        self.write_every_s = write_every_s
        self.observations: list[Observation] = []
        self.sessions = 0
        self.failed = 0
        self.started = time.monotonic()
        self.run_id = uuid.uuid4().hex[:8]

    def stock(self, number: int) -> bool:
        """Whether session ``number`` is sent without session headers (``stock_share`` of them, spread evenly)."""
        return int((number + 1) * self.stock_share) > int(number * self.stock_share)

    async def _ask(
        self,
        http: httpx.AsyncClient,
        session_id: str | None,
        messages: list[dict[str, str]],
        done: bool,
        persona: str,
    ) -> tuple[Any, str]:
        """The response and the session id the proxy recorded it under (``session_id``, or the one it found)."""
        headers = dict(self.headers)
        if session_id is not None:
            headers["X-Session-Id"] = session_id
            if done:
                headers["X-Session-Done"] = "true"
        body = {
            "model": "policy",
            "messages": messages,
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "user": persona,  # OpenAI's end-user field: recorded on the turn, the console filters by it
        }
        for attempt in range(5):
            try:
                r = await http.post(self.url, json=body, headers=headers, timeout=300)
                if r.status_code == 200:
                    return r.json(), r.headers.get("x-session-id", session_id or "")
                log.warning("proxy answered %s: %s", r.status_code, r.text[:200])
            except httpx.HTTPError as exc:
                log.warning("proxy unreachable: %r", exc)
            self.failed += 1
            FAILED.inc()
            await asyncio.sleep(min(2**attempt, 10))
        return None, ""

    async def session(self, http: httpx.AsyncClient, number: int) -> None:
        persona = self.personas[number % len(self.personas)]
        sent_id = None if self.stock(number) else f"sim-{self.run_id}-{number}"
        messages = [user(self.rng.choice(self.questions))]
        for turn in range(self.turns + 1):
            last = turn == self.turns
            data, session_id = await self._ask(http, sent_id, messages, done=last, persona=persona.name)
            if data is None or last:
                break
            text = (data["choices"][0]["message"].get("content") or "").strip()
            version = str((data.get("metadata") or {}).get("weight_version", "0"))
            ok = persona.satisfied(text)
            RESPONSES.labels(persona.name, str(ok).lower()).inc()
            self.observations.append(
                Observation(
                    session_id=session_id,
                    turn=turn + 1,
                    persona=persona.name,
                    weight_version=int(version) if version.isdigit() else 0,
                    satisfied=ok,
                    words=len(text.split()),
                    completion_tokens=int((data.get("usage") or {}).get("completion_tokens", 0)),
                    at=time.time(),
                )
            )
            reply = (
                f"{persona.thanks} Next question: {self.rng.choice(self.questions)}"
                if ok
                else persona.correction
            )
            messages += [{"role": "assistant", "content": text}, user(reply)]
        self.sessions += 1

    async def run(
        self, users: int, sessions: int | None = None, stop: asyncio.Event | None = None
    ) -> Summary:
        """``users`` concurrent users; ``sessions`` in all (None: until ``stop``)."""
        numbers = iter(range(sessions)) if sessions is not None else itertools.count()
        stop = stop or asyncio.Event()
        written = time.monotonic()

        async def user(http: httpx.AsyncClient) -> None:
            nonlocal written
            for number in numbers:
                if stop.is_set():
                    return
                await self.session(http, number)
                if time.monotonic() - written > self.write_every_s:
                    written = time.monotonic()
                    await asyncio.to_thread(self.write)

        async with httpx.AsyncClient() as http:
            users_done = asyncio.gather(*(user(http) for _ in range(users)))
            stopped = asyncio.ensure_future(stop.wait())
            either: set[asyncio.Future[Any]] = {users_done, stopped}
            await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
            if not users_done.done():  # stopped: sessions in flight are abandoned, their turns stay recorded
                users_done.cancel()
                await asyncio.gather(users_done, return_exceptions=True)
            stopped.cancel()
        await asyncio.to_thread(self.write)
        return self.summary()

    def summary(self) -> Summary:
        return summarize(self.observations, self.sessions, self.failed, time.monotonic() - self.started)

    def write(self) -> None:
        """``summary.json``, ``observations.jsonl`` and ``learning.png`` in the output folder (if any)."""
        if self.out_dir is None:
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        summary = self.summary()
        (self.out_dir / "summary.json").write_bytes(msgspec.json.format(msgspec.json.encode(summary)))
        (self.out_dir / "observations.jsonl").write_bytes(
            b"".join(msgspec.json.encode(o) + b"\n" for o in self.observations)
        )
        if summary.versions:
            plot(summary, self.out_dir / "learning.png")


async def run_simulate(
    proxy_url: str,
    personas: tuple[Persona, ...],
    *,
    users: int,
    sessions: int | None,
    out_dir: Path,
    turns: int = 3,
    max_tokens: int = 64,
    seed: int = 0,
    api_key: str | None = None,
    metrics_port: int | None = None,
    stock_share: float = 0.5,
) -> Summary:
    """The ``turnstream simulate`` command: until ``sessions`` are done, or SIGTERM/SIGINT."""
    import signal

    from runtime.observability.metrics import serve_metrics

    serve_metrics(metrics_port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    sim = Simulator(
        proxy_url,
        personas,
        turns=turns,
        max_tokens=max_tokens,
        seed=seed,
        api_key=api_key,
        out_dir=out_dir,
        stock_share=stock_share,
    )
    log.info("simulating", extra={"users": users, "sessions": sessions, "out": str(out_dir)})
    summary = await sim.run(users, sessions, stop)
    log.info("simulation done", extra={"responses": summary.responses, "sessions": summary.sessions})
    return summary

"""Every client as shipped, all at once, through the real proxy to the real SGLang, Kafka and Redis: Codex CLI (the
Responses API), Claude Code (Anthropic's Messages API), opencode (chat completions) and stock OpenClaw (chat
completions, headless, the lean config of docs/clients.md, no session headers). Each holds two conversations,
interleaved, as two users of one machine; the four clients run concurrently, each through a proxy of its own (so
that each proxy's counts are its client's), into one namespace: one pipeline takes what they all said. Each
conversation becomes one turnstream session found from what the client sends on its own; its turns are paired
with what the user said next; the rules judge scores the user's correction -1 (through OpenClaw's timestamp too);
the dispatcher makes the corrected turns training samples; and one step of the real trainer takes a sample from
each client: turns of the three APIs are one kind of sample.

The clients are installed by ``scripts/agents.sh install`` and ``scripts/openclaw.sh install`` (Node 24 and the
packages from the npm registry into the cache; ``scripts/test.sh`` runs both), configured only with the base URL,
a key and what makes their prompts fit SmolLM2's 8,192 tokens. Each call starts the client (Node) and sends a
prompt of 2,000 tokens or more; answers are kept short (96 tokens for the agents, OpenClaw's 16) because on the
CPU SGLang decodes at about 7 tokens a second at that context length. Run at once, the clients' answers are
decoded in one batch and their Node start-ups overlap the engine's work."""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import subprocess
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from runtime.configuration.config import Config, JudgeConfig, KafkaConfig, RedisConfig
from runtime.messaging.topics import create_topics
from runtime.pipeline.envelopes import conversation, request_only, visible_answer
from schemas import Judgment, PairedTurn, Sample, SessionEnded, Turn
from schemas.topics import SESSIONS_ENDED, TURNS
from services.engine.launch import EngineProcess
from services.trainer.model import read_hf_weights
from tests.clients.learning import judged, taught, trained
from tests.conftest import TEST_PARTITIONS, namespaced_kafka, proxy_settings
from tests.infra import Service
from tests.kafka_wait import wait_for_events
from tests.metrics import scraped
from tests.services.proxy.conftest import ProxyProcess, pair_all
from tests.services.trainer.conftest import publish

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1500)]
REPO = Path(__file__).resolve().parents[2]
AGENTS, OPENCLAW = REPO / "scripts" / "agents.sh", REPO / "scripts" / "openclaw.sh"
API = {"codex": "responses", "claude": "messages", "opencode": "chat"}
MESSAGES = ("What is 2+2? Answer briefly.", "No, answer in one word.", "Thanks.")
# Two messages: the correction pairs the first turn (what the judge reads); each OpenClaw call costs a Node start
# and a 2,000-token prompt, so a third would add a minute and no check.
CLAW_MESSAGES = ("What is 2+2?", "No, answer in one word.")
CORRECTION = "No, answer in one word."
CLIENTS = (*API, "openclaw")
CUT = {
    "codex": "Incomplete response returned, reason: max_output_tokens",
    "claude": "response exceeded the",
    "opencode": "",
}
"""How each agent reports an answer cut at its length limit: Codex and Claude Code exit 1 then. SmolLM2-135M at
temperature 1 (what they get: neither sends one) often rambles to the limit; the turn was served and recorded all
the same, so that exit is the model's doing, not the proxy's."""


def agent_turn(agent: str, folder: Path, base_url: str, message: str, again: bool) -> None:
    done = subprocess.run(
        ["bash", str(AGENTS), agent, str(folder), base_url, message, *(["--again"] if again else [])],
        env={**os.environ, "AGENTS_TIMEOUT": "400", "AGENTS_MAX_TOKENS": "96"},
        capture_output=True, text=True, timeout=450,
    )  # fmt: skip
    cut = done.returncode == 1 and CUT[agent] and CUT[agent] in done.stdout + done.stderr
    assert done.returncode == 0 or cut, done.stdout[-2000:] + done.stderr[-3000:]


def claw(*args: str, **env: str) -> str:
    done = subprocess.run(
        ["bash", str(OPENCLAW), *args], env={**os.environ, **env}, capture_output=True, text=True, timeout=400
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return done.stdout


def drive(client: str, folder: Path, base_url: str) -> None:
    """The client's two conversations, interleaved, message by message."""
    if client == "openclaw":
        # The answer length is OpenClaw's model setting (maxTokens, sent as max_completion_tokens), written here.
        claw("config", str(folder), base_url + "/v1", "--lean", OPENCLAW_MAX_TOKENS="16")
        for message in CLAW_MESSAGES:
            for session in ("alpha", "beta"):
                out = claw("agent", str(folder), session, message, OPENCLAW_TIMEOUT="300")
                json.loads(out[out.index("{") :])
        return
    for i, message in enumerate(MESSAGES):
        for name in ("alpha", "beta"):
            agent_turn(client, folder / name, base_url, message, i > 0)


def said(t: Turn) -> str:
    """The user's message this turn answered (the last user message of its request)."""
    return next(m for m in reversed(t.messages) if m.role == "user").text.strip()


def openclaw_session(turn: Turn) -> str | None:
    """The OpenClaw session a recorded turn came from (OpenClaw writes it into the first user message)."""
    first = next((m for m in turn.messages if m.role == "user"), None)
    found = re.search(r"sessionId=(\w+)", first.text) if first else None
    return found.group(1) if found else None


def client_of(turn: Turn) -> str:
    if turn.api != "chat":
        return {api: client for client, api in API.items()}[turn.api]
    return "openclaw" if openclaw_session(turn) else "opencode"


def retry(turn: Turn) -> bool:
    """Whether OpenClaw sent this turn's request to retry an attempt: it ends with its one-time instruction."""
    return request_only(turn.messages[-1]) and "user-visible answer" in turn.messages[-1].text


def all_said(turns: list[Turn], client: str) -> bool:
    """Whether every message of both of the client's conversations has its recorded turn."""
    mine = [t for t in turns if client_of(t) == client]
    if client == "openclaw":
        return all(
            any(openclaw_session(t) == s and said(t).endswith(m) for t in mine)
            for s in ("alpha", "beta")
            for m in CLAW_MESSAGES
        )
    return all(sum(said(t) == m for t in mine) >= 2 for m in MESSAGES)


@dataclass
class Run:
    """What the four clients did, and what the one pipeline made of it."""

    config: Config
    errors: dict[str, BaseException]
    turns: list[Turn]
    sessions_counted: dict[str, dict[str, float]]
    """Each client's proxy's ``turnstream_proxy_sessions_total`` by how."""
    regenerated: set[tuple[str, int]] = field(default_factory=set)
    pairs: list[PairedTurn] = field(default_factory=list)
    verdicts: dict[tuple[str, str], Judgment] = field(default_factory=dict)
    samples: dict[str, Sample] = field(default_factory=dict)

    def of(self, client: str) -> list[Turn]:
        if client in self.errors:
            raise self.errors[client]
        return [t for t in self.turns if client_of(t) == client]

    def corrections(self, client: str) -> list[PairedTurn]:
        mine = {t.turn_id for t in self.of(client)}
        return [
            p
            for p in self.pairs
            if p.turn_id in mine and p.next_state and any(CORRECTION in m.text for m in p.next_state)
        ]


def open_sessions(turns: list[Turn], regenerated: set[tuple[str, int]]) -> int:
    """Sessions whose last turn stays unpaired: every one but those a regenerate closed."""
    return len({t.session_id for t in turns} - {sid for sid, _ in regenerated})


@pytest.fixture(scope="module")
async def ran(
    kafka_service: Service,
    redis_service: Service,
    engine: EngineProcess,
    tmp_path_factory: pytest.TempPathFactory,
) -> AsyncIterator[Run]:
    for script in (AGENTS, OPENCLAW):
        await asyncio.to_thread(subprocess.run, ["bash", str(script), "install"], check=True, timeout=900)
    namespace = f"test-{uuid.uuid4().hex[:12]}."
    kafka = namespaced_kafka(kafka_service.address, redis_service.address, namespace, **kafka_service.login)
    await create_topics(kafka, partitions=TEST_PARTITIONS)
    redis = RedisConfig(url=redis_service.address, key_prefix=f"test-{uuid.uuid4().hex[:12]}:")
    root = tmp_path_factory.mktemp("clients")
    env = proxy_settings(kafka, redis, engine, root)
    # Codex and opencode set no answer length: on the CPU a rambling answer would take minutes.
    capped = {"TURNSTREAM_PROXY_DEFAULT_MAX_TOKENS": "96"}
    proxies = {c: ProxyProcess({**env, **({} if c == "openclaw" else capped)}) for c in CLIENTS}
    try:
        outcomes = await asyncio.gather(
            *(asyncio.to_thread(drive, c, root / c, proxies[c].url) for c in CLIENTS), return_exceptions=True
        )
        errors = {c: e for c, e in zip(CLIENTS, outcomes, strict=True) if isinstance(e, BaseException)}
        ok = [c for c in CLIENTS if c not in errors]
        turns: list[Turn] = await wait_for_events(
            kafka, TURNS, lambda ts: all(all_said(ts, c) for c in ok), 120
        )
        counted = {
            c: {
                how: scraped(proxies[c].url, "turnstream_proxy_sessions_total", how=how)
                for how in ("explicit", "unresolved")
            }
            for c in CLIENTS
        }
    finally:
        for proxy in proxies.values():
            proxy.stop()
    config = Config(kafka=kafka, redis=redis, judge=JudgeConfig(backend="rules"))
    run = Run(config, errors, [t for t in turns if client_of(t) in ok], counted)
    ended: list[SessionEnded] = await wait_for_events(kafka, SESSIONS_ENDED, lambda _: True, 1)
    run.regenerated = {(e.session_id, e.after_turn_index) for e in ended if e.reason == "regenerated"}
    run.pairs = await pair_all(config, expect=len(run.turns) - open_sessions(run.turns, run.regenerated))
    wanted = {p.turn_id for c in ok for p in run.corrections(c)}
    run.verdicts = await judged(config, wanted)
    run.samples = await taught(config, wanted)
    yield run


def story(turns: list[Turn]) -> list[tuple[str, int, str, str, str]]:
    return [(t.session_id, t.turn_index, said(t)[:40], t.response.text[:40], t.api) for t in turns]


def assert_learned(run: Run, client: str) -> None:
    """Its corrections paired, judged -1 with the correction as the hint, and made -1 samples of its sessions."""
    corrections = run.corrections(client)
    assert len(corrections) == 2, [p.next_state for p in run.pairs]
    wanted = {p.turn_id for p in corrections}
    assert all(run.verdicts[(t, "eval")].eval_score == -1 for t in wanted), run.verdicts
    assert all(
        run.verdicts[(t, "hint")].accepted and run.verdicts[(t, "hint")].hint == "Answer in one word."
        for t in wanted
    ), run.verdicts
    sessions = {t.session_id for t in run.of(client)}
    samples = {s: run.samples[s] for s in wanted if s in run.samples}
    assert samples.keys() == wanted, run.samples.keys()
    assert all(
        s.reward == -1 and s.response_length > 0 and s.session_id in sessions for s in samples.values()
    )


@pytest.mark.parametrize("agent", list(API))
def test_an_agent_as_shipped_teaches_the_model(agent: str, ran: Run) -> None:
    turns = ran.of(agent)
    assert ran.sessions_counted[agent]["explicit"] >= 6  # every turn's session named by the agent itself
    told = story(turns)
    assert {t.api for t in turns} == {API[agent]}, told
    # The cap applies where the agent sets none, recorded as sent; Claude Code sends its own.
    assert {t.sampling.max_tokens for t in turns} == {96}, told
    sessions: dict[str, list[Turn]] = {}
    for t in sorted(turns, key=lambda t: t.turn_index):
        sessions.setdefault(t.session_id, []).append(t)
    # One session per conversation, found from what the agent sends (its own session id), numbered in order; the
    # agent's housekeeping (opencode's title request) is not among them.
    assert len(sessions) == 2, told
    for ts in sessions.values():
        assert [t.turn_index for t in ts] == list(range(1, len(ts) + 1)), told
        assert list(dict.fromkeys(said(t) for t in ts if said(t) in MESSAGES)) == list(MESSAGES), told
        assert len(ts[-1].messages) > len(ts[0].messages), told  # each turn carries the conversation so far
    mine = {t.turn_id for t in turns}
    assert not any(p.misaligned for p in ran.pairs if p.turn_id in mine), told
    assert_learned(ran, agent)


def test_stock_openclaw_sessions_become_paired_sessions(ran: Run) -> None:
    turns = ran.of("openclaw")
    by_claw: dict[str, list[Turn]] = {}
    for t in sorted(turns, key=lambda t: t.created_at):
        by_claw.setdefault(openclaw_session(t) or "", []).append(t)
    assert by_claw.keys() == {"alpha", "beta"}
    # One turnstream session per OpenClaw session, but for OpenClaw's own retries: an empty answer is asked again
    # with the same history plus an instruction sent once (fixtures/openclaw/empty.jsonl), a regenerate, which
    # starts a session (a branch, or a new one for an opening) and closes a superseded turn as `regenerated`.
    told = {
        c: [(t.session_id, t.turn_index, retry(t), t.response.text[:40]) for t in ts]
        for c, ts in by_claw.items()
    }
    for ts in by_claw.values():
        retries = [t for t in ts if retry(t)]
        assert all(t.turn_index == 1 for t in retries), told
        assert len({t.session_id for t in ts}) == 1 + len(retries), told
        for (
            t
        ) in retries:  # what it retried: the attempt before it with the same history, answered with nothing
            tried = next(
                u for u in reversed(ts[: ts.index(t)]) if conversation(u.messages) == conversation(t.messages)
            )
            assert not visible_answer(tried.response.text).strip() and not tried.response.tool_calls, told
            if tried.turn_index > 1:
                assert (tried.session_id, tried.turn_index) in ran.regenerated, (told, ran.regenerated)
    indexes: dict[str, list[int]] = {}
    for t in turns:
        indexes.setdefault(t.session_id, []).append(t.turn_index)
    assert all(sorted(ix) == list(range(1, len(ix) + 1)) for ix in indexes.values()), indexes
    # No session header: every session found from the history it repeats, none unresolved.
    assert ran.sessions_counted["openclaw"] == {"explicit": 0, "unresolved": 0}
    # Every turn is paired but each session's last one, unless a regenerate closed it (an opening OpenClaw retried
    # stays open until the idle sweep).
    mine = [p for p in ran.pairs if p.turn_id in {t.turn_id for t in turns}]
    assert len(mine) == len(turns) - open_sessions(turns, ran.regenerated), told
    assert not any(p.misaligned for p in mine)
    # The rules judge reads the correction through OpenClaw's timestamp.
    for p in ran.corrections("openclaw"):
        assert all(
            re.fullmatch(r"\[\w{3} \d{4}-\d\d-\d\d \d\d:\d\d [^\]]+\] No, answer in one word\.", m.text)
            for m in p.next_state or []
        )
    assert_learned(ran, "openclaw")


async def test_what_the_clients_taught_trains_the_policy(
    ran: Run, kafka: KafkaConfig, small_smollm2: Path, tmp_path: Path
) -> None:
    """One step of the real trainer (Megatron-core on the CPU) on a corrected turn of each client: turns of the
    three APIs are one kind of sample. On SmolLM2 cut to two layers (tests/conftest.py): the step's logic over
    agent-length samples is the point here, not the 30 trained layers (minutes on one CPU thread)."""
    taught = [min((s for s in ran.samples.values() if s.session_id in {t.session_id for t in ran.of(c)}),
                  key=lambda s: s.sample_id) for c in CLIENTS]  # fmt: skip
    await publish(kafka, taught)
    version = await trained(Config(kafka=kafka), small_smollm2, tmp_path / "weights", batch=len(taught))
    assert version.version == 1, version
    assert sorted(version.sample_ids) == sorted(s.sample_id for s in taught), version
    assert version.advantages == [-1.0] * len(taught), version  # rl: the judged reward, the correction's -1
    assert all(math.isfinite(v) for v in version.figures.values()), version.figures
    before, after = read_hf_weights(small_smollm2), read_hf_weights(Path(version.path))
    assert any(not torch.equal(after[k], before[k]) for k in before), "the step changed no weight"

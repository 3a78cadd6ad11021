"""Stock OpenClaw from npm (``openclaw@2026.9.6``, headless, lean config, no session headers) through the real proxy
to the real SGLang, Kafka and Redis: each OpenClaw session becomes one turnstream session whose turns are paired
with what the user said next, the rules judge reads the user's correction through OpenClaw's timestamp, and the
dispatcher makes the corrected turns training samples.

OpenClaw is installed by ``scripts/openclaw.sh install`` (Node 24 and OpenClaw from the npm registry into the
cache; ``scripts/test.sh`` runs it). Each OpenClaw call starts a Node process (about 10 s here) and sends a
2,000-token prompt: answers are kept to 16 tokens."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from runtime.configuration.config import Config, JudgeConfig, KafkaConfig, RedisConfig
from runtime.pipeline.envelopes import conversation, request_only, visible_answer
from schemas import SessionEnded, Turn
from schemas.topics import SESSIONS_ENDED
from tests.clients.learning import judged, taught
from tests.kafka_wait import wait_for_events
from tests.metrics import scraped
from tests.services.proxy.conftest import ProxyProcess, pair_all, wait_for_turns

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1200)]
SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "openclaw.sh"
# Two messages: the correction pairs the first turn (what the judge reads); each OpenClaw call costs about 80 s
# here (Node and its 2,000-token prompt), so a third would add three minutes and no check.
MESSAGES = ("What is 2+2?", "No, answer in one word.")


def agent(state: Path, session: str, message: str) -> dict[str, object]:
    env = {**os.environ, "OPENCLAW_TIMEOUT": "300"}
    done = subprocess.run(
        ["bash", str(SCRIPT), "agent", str(state), session, message],
        env=env, capture_output=True, text=True, timeout=400,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return json.loads(done.stdout[done.stdout.index("{") :])


def setup(state: Path, base_url: str) -> None:
    subprocess.run(["bash", str(SCRIPT), "install"], check=True, timeout=600)
    # The answer length is OpenClaw's model setting (maxTokens, sent as max_completion_tokens), written here.
    env = {**os.environ, "OPENCLAW_MAX_TOKENS": "16"}
    subprocess.run(
        ["bash", str(SCRIPT), "config", str(state), base_url, "--lean"], check=True, timeout=300, env=env
    )


def openclaw_session(turn: Turn) -> str:
    """The OpenClaw session a recorded turn came from: OpenClaw writes it into the first user message."""
    first = next(m for m in turn.messages if m.role == "user")
    found = re.search(r"sessionId=(\w+)", first.text)
    assert found, first.text[:300]
    return found.group(1)


def retry(turn: Turn) -> bool:
    """Whether OpenClaw sent this turn's request to retry an attempt: it ends with its one-time instruction."""
    return request_only(turn.messages[-1]) and "user-visible answer" in turn.messages[-1].text


async def test_stock_openclaw_sessions_become_paired_sessions(
    proxy: ProxyProcess, proxy_env: dict[str, str], kafka: KafkaConfig, tmp_path: Path
) -> None:
    state = tmp_path / "openclaw"
    await asyncio.to_thread(setup, state, proxy.url + "/v1")
    for message in MESSAGES:  # two sessions, interleaved, as two users of one OpenClaw
        for session in ("alpha", "beta"):
            await asyncio.to_thread(agent, state, session, message)
    turns = await wait_for_turns(kafka, 6)
    by_claw: dict[str, list[Turn]] = {}
    for t in sorted(turns, key=lambda t: t.created_at):
        by_claw.setdefault(openclaw_session(t), []).append(t)
    assert by_claw.keys() == {"alpha", "beta"}
    # One turnstream session per OpenClaw session, but for OpenClaw's own retries: an empty answer is asked again
    # with the same history plus an instruction sent once (fixtures/openclaw/empty.jsonl), a regenerate, which
    # starts a session (a branch, or a new one for an opening) and closes a superseded turn as `regenerated`.
    ended: list[SessionEnded] = await wait_for_events(kafka, SESSIONS_ENDED, lambda _: True, 1)
    regenerated = {(e.session_id, e.after_turn_index) for e in ended if e.reason == "regenerated"}
    story = {
        claw: [(t.session_id, t.turn_index, retry(t), t.response.text[:40]) for t in ts]
        for claw, ts in by_claw.items()
    }
    for ts in by_claw.values():
        retries = [t for t in ts if retry(t)]
        assert all(t.turn_index == 1 for t in retries), story
        assert len({t.session_id for t in ts}) == 1 + len(retries), story
        for (
            t
        ) in retries:  # what it retried: the attempt before it with the same history, answered with nothing
            tried = next(
                u for u in reversed(ts[: ts.index(t)]) if conversation(u.messages) == conversation(t.messages)
            )
            assert not visible_answer(tried.response.text).strip() and not tried.response.tool_calls, story
            if tried.turn_index > 1:
                assert (tried.session_id, tried.turn_index) in regenerated, (story, regenerated)
    indexes: dict[str, list[int]] = {}
    for t in turns:
        indexes.setdefault(t.session_id, []).append(t.turn_index)
    assert all(sorted(ix) == list(range(1, len(ix) + 1)) for ix in indexes.values()), indexes
    assert scraped(proxy.url, "turnstream_proxy_sessions_total", how="unresolved") == 0
    assert scraped(proxy.url, "turnstream_proxy_sessions_total", how="explicit") == 0
    print(json.dumps(story, indent=1))  # shown when a later check fails
    config = Config(
        kafka=kafka,
        redis=RedisConfig(
            url=proxy_env["TURNSTREAM_REDIS_URL"], key_prefix=proxy_env["TURNSTREAM_REDIS_KEY_PREFIX"]
        ),
        judge=JudgeConfig(backend="rules"),
    )
    # Every turn is paired but each session's last one, unless a regenerate closed it (an opening OpenClaw retried
    # stays open until the idle sweep).
    open_sessions = set(indexes) - {sid for sid, _ in regenerated}
    pairs = await pair_all(config, expect=len(turns) - len(open_sessions))
    assert len(pairs) == len(turns) - len(open_sessions), story
    assert not any(p.misaligned for p in pairs)
    corrections = [
        p for p in pairs if p.next_state and any("No, answer in one word." in m.text for m in p.next_state)
    ]
    assert len(corrections) == 2, [p.next_state for p in pairs]
    assert all(
        re.fullmatch(r"\[\w{3} \d{4}-\d\d-\d\d \d\d:\d\d [^\]]+\] No, answer in one word\.", m.text)
        for p in corrections
        for m in p.next_state or []
    )
    # The rules judge reads the correction through OpenClaw's timestamp: -1, with the correction as the hint.
    wanted = {p.turn_id for p in corrections}
    verdicts = await judged(config, wanted)
    assert all(verdicts[(t, "eval")].eval_score == -1 for t in wanted), verdicts
    assert all(
        verdicts[(t, "hint")].accepted and verdicts[(t, "hint")].hint == "Answer in one word." for t in wanted
    )
    # And they become training samples (mode rl: the judged reward), which the trainer takes from any client.
    samples = await taught(config, wanted)
    sessions = {t.session_id for t in turns}
    assert samples.keys() == wanted and all(
        s.reward == -1 and s.session_id in sessions for s in samples.values()
    )

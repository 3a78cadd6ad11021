"""The coding agents as shipped on npm, driven headless through the real proxy to the real SGLang, Kafka and Redis:
Codex CLI (the Responses API), Claude Code (Anthropic's Messages API) and opencode (chat completions). For each,
two conversations of three messages, interleaved, become two turnstream sessions found from what the agent sends
on its own; the turns are paired with what the user said next, the rules judge scores the user's correction -1,
the dispatcher makes the corrected turns training samples, and the trainer
takes a step on one of each agent's.

The agents are installed by ``scripts/agents.sh install`` (Node 24 and the three packages from the npm registry
into the cache; ``scripts/test.sh`` runs it), configured only with the base URL, a key and what makes their prompt
fit SmolLM2's 8,192 tokens (``scripts/agents.sh`` says what)."""

from __future__ import annotations

import asyncio
import math
import os
import subprocess
from pathlib import Path

import pytest
import torch

from runtime.configuration.config import Config, JudgeConfig, KafkaConfig, RedisConfig
from schemas import Sample, Turn
from schemas.topics import TURNS
from services.trainer.model import read_hf_weights
from tests.clients.learning import judged, taught, trained
from tests.kafka_wait import wait_for_events
from tests.metrics import scraped
from tests.services.proxy.conftest import ProxyProcess, pair_all
from tests.services.trainer.conftest import publish

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(1500),
    pytest.mark.engine_lane,
]  # one process: TAUGHT
SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "agents.sh"
MESSAGES = ("What is 2+2? Answer briefly.", "No, answer in one word.", "Thanks.")
CORRECTION = MESSAGES[1]
API = {"codex": "responses", "claude": "messages", "opencode": "chat"}
TAUGHT: dict[str, Sample] = {}
"""A corrected turn's sample from each agent's test, for the one trainer step at the end."""


CUT = {
    "codex": "Incomplete response returned, reason: max_output_tokens",
    "claude": "response exceeded the",
    "opencode": "",
}
"""How each agent reports an answer cut at its length limit: Codex and Claude Code exit 1 then. SmolLM2-135M at
temperature 1 (what they get: neither sends one) often rambles to the limit; the turn was served and recorded all
the same, so that exit is the model's doing, not the proxy's."""


def turn(agent: str, folder: Path, base_url: str, message: str, again: bool) -> str:
    done = subprocess.run(
        ["bash", str(SCRIPT), agent, str(folder), base_url, message, *(["--again"] if again else [])],
        env={**os.environ, "AGENTS_TIMEOUT": "400", "AGENTS_MAX_TOKENS": "96"},
        capture_output=True, text=True, timeout=450,
    )  # fmt: skip
    cut = done.returncode == 1 and CUT[agent] and CUT[agent] in done.stdout + done.stderr
    assert done.returncode == 0 or cut, done.stdout[-2000:] + done.stderr[-3000:]
    return done.stdout


def said(t: Turn) -> str:
    """The user's message this turn answered (the last user message of its request)."""
    return next(m for m in reversed(t.messages) if m.role == "user").text.strip()


@pytest.fixture(scope="module")
def installed() -> None:
    subprocess.run(["bash", str(SCRIPT), "install"], check=True, timeout=900)


@pytest.mark.parametrize("agent", list(API))
async def test_an_agent_as_shipped_teaches_the_model(
    agent: str,
    installed: None,
    proxy_env: dict[str, str],
    kafka: KafkaConfig,
    tmp_path: Path,
) -> None:
    # Codex and opencode set no answer length: on the CPU a rambling answer would take minutes.
    proxy = ProxyProcess({**proxy_env, "TURNSTREAM_PROXY_DEFAULT_MAX_TOKENS": "96"})
    try:
        outputs = []
        for i, message in enumerate(MESSAGES):  # two conversations, interleaved, as two users of one machine
            for conversation in ("alpha", "beta"):
                folder = tmp_path / conversation
                out = await asyncio.to_thread(turn, agent, folder, proxy.url, message, i > 0)
                outputs.append(out)
        # Every message of both conversations recorded (an agent may make more requests than messages: Claude Code
        # asks again after an answer cut at its limit).
        turns: list[Turn] = await wait_for_events(
            kafka, TURNS, lambda ts: all(sum(said(t) == m for t in ts) >= 2 for m in MESSAGES), 120
        )
        assert scraped(proxy.url, "turnstream_proxy_sessions_total", how="explicit") >= 6
    finally:
        proxy.stop()
    story = [(t.session_id, t.turn_index, said(t)[:40], t.response.text[:40], t.api) for t in turns]
    assert {t.api for t in turns} == {API[agent]}, story
    # The cap applies where the agent sets none, recorded as sent; Claude Code sends its own.
    assert {t.sampling.max_tokens for t in turns} == {96}, story
    sessions: dict[str, list[Turn]] = {}
    for t in sorted(turns, key=lambda t: t.turn_index):
        sessions.setdefault(t.session_id, []).append(t)
    # One session per conversation, found from what the agent sends (its own session id), numbered in order; the
    # agent's housekeeping (opencode's title request) is not among them.
    assert len(sessions) == 2, story
    for ts in sessions.values():
        assert [t.turn_index for t in ts] == list(range(1, len(ts) + 1)), story
        assert list(dict.fromkeys(said(t) for t in ts if said(t) in MESSAGES)) == list(MESSAGES), story
        assert len(ts[-1].messages) > len(ts[0].messages), story  # each turn carries the conversation so far

    config = Config(
        kafka=kafka,
        redis=RedisConfig(
            url=proxy_env["TURNSTREAM_REDIS_URL"], key_prefix=proxy_env["TURNSTREAM_REDIS_KEY_PREFIX"]
        ),
        judge=JudgeConfig(backend="rules"),
    )
    pairs = await pair_all(config, expect=len(turns) - 2)  # every turn but each session's last
    assert not any(p.misaligned for p in pairs), story
    corrections = [
        p for p in pairs if p.next_state and any(m.text.strip() == CORRECTION for m in p.next_state)
    ]
    assert len(corrections) == 2, (story, [p.next_state for p in pairs])
    wanted = {p.turn_id for p in corrections}
    verdicts = await judged(config, wanted)
    assert all(verdicts[(t, "eval")].eval_score == -1 for t in wanted), verdicts
    assert all(verdicts[(t, "hint")].hint == "Answer in one word." for t in wanted), verdicts
    samples = await taught(config, wanted)
    assert samples.keys() == wanted, samples
    assert all(s.reward == -1 and s.response_length > 0 for s in samples.values()), samples
    TAUGHT[agent] = min(samples.values(), key=lambda s: s.sample_id)


async def test_what_the_agents_taught_trains_the_policy(
    kafka: KafkaConfig, smollm2_path: Path, tmp_path: Path
) -> None:
    """One step of the real trainer (Megatron-core on the CPU, from the weights the engine serves) on a corrected
    turn of each agent: turns of the three APIs are one kind of sample. One step for all three, because a trainer
    start costs minutes here; the agents' tests above leave their samples for it."""
    assert TAUGHT.keys() == API.keys(), "run the whole file: the agents' tests above make these samples"
    await publish(kafka, list(TAUGHT.values()))
    version = await trained(Config(kafka=kafka), smollm2_path, tmp_path / "weights", batch=len(TAUGHT))
    assert version.version == 1, version
    assert sorted(version.sample_ids) == sorted(s.sample_id for s in TAUGHT.values()), version
    assert version.advantages == [-1.0] * len(TAUGHT), version  # rl: the judged reward, the correction's -1
    assert all(math.isfinite(v) for v in version.figures.values()), version.figures
    before, after = read_hf_weights(smollm2_path), read_hf_weights(Path(version.path))
    assert any(not torch.equal(after[k], before[k]) for k in before), "the step changed no weight"

"""``turnstream run`` for real: every service starts (two SGLang servers, proxy, pairer, judge, teacher, dispatcher,
trainer, eval, console), turns sent through the proxy show up in the live progress and in the console (in Chromium),
and SIGTERM stops every process cleanly."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from runtime.configuration.config import KafkaConfig, RedisConfig, load_config
from runtime.messaging.bus import read_topic
from runtime.pipeline.personas import heldout_questions
from runtime.process.ports import free_port, free_port_block
from runtime.security.tokens import engine_keys
from runtime.transport.redis_urls import redis_client
from schemas.topics import DEADLETTER, EVALS, JUDGMENTS, SAMPLES, TEACHER, TURNS, WEIGHTS
from services.run.plan import METRICS_SERVICES, plan
from tests.browser import check_console

# Two SGLang servers start in each run: 2-3 minutes of the two cores before the first turn.
pytestmark = [pytest.mark.integration, pytest.mark.timeout(1200), pytest.mark.starts_engines(2)]
ROOT = Path(__file__).resolve().parents[3]


def wait_status(
    run_dir: Path, proc: subprocess.Popen[bytes], ok: object, timeout: float
) -> dict[str, object]:
    deadline = time.monotonic() + timeout
    status: dict[str, object] = {}
    while time.monotonic() < deadline:
        assert proc.poll() is None, (run_dir / "run.out").read_text()[-3000:]
        try:
            status = json.loads((run_dir / "status.json").read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            status = {}
        if status and ok(status):  # type: ignore[operator]
            return status
        time.sleep(0.5)
    raise AssertionError(f"status never satisfied the test: {status}")


def start_run(
    kafka: KafkaConfig,
    redis_config: RedisConfig,
    model: Path,
    tmp_path: Path,
    run_dir: Path,
    proxy_port: int,
    *extra: str,
    **settings: str,
) -> subprocess.Popen[bytes]:
    """``turnstream run`` against the test broker and Redis, every port and folder its own."""
    env = {
        **os.environ,
        **kafka.client_env(),
        "TURNSTREAM_REDIS_URL": redis_config.url,
        "TURNSTREAM_REDIS_KEY_PREFIX": redis_config.key_prefix,
        "TURNSTREAM_RUN_ENGINE_PORT": str(free_port()),
        "TURNSTREAM_RUN_TEACHER_ENGINE_PORT": str(free_port()),
        "TURNSTREAM_RUN_METRICS_PORT_BASE": str(free_port_block(len(METRICS_SERVICES))),
        "TURNSTREAM_CONSOLE_PORT": str(free_port()),
        "TURNSTREAM_CONSOLE_DB_PATH": str(tmp_path / "console.sqlite3"),
        "TURNSTREAM_PROXY_PORT": str(proxy_port),
        "TURNSTREAM_PROXY_SPOOL_DIR": str(tmp_path / "spool"),
        "TURNSTREAM_PROXY_WEIGHTS_ROOT": str(tmp_path / "weights"),
        "TURNSTREAM_TRAINER_OUTPUT_DIR": str(tmp_path / "weights"),
        "TURNSTREAM_TRAINER_HF_CHECKPOINT": str(model),
        "TURNSTREAM_LOGGING_FORMAT": "text",
        **settings,
    }
    run_dir.mkdir()
    with open(run_dir / "run.out", "w") as out:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "services.cli",
                "run",
                "--no-local-infra",
                "--run-dir",
                str(run_dir),
                *extra,
            ],
            env=env,
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


async def simulated_turn_at(kafka: KafkaConfig, version: int) -> bool:
    async for r in read_topic(kafka, TURNS):
        if r.event.session_id.startswith("sim-") and r.event.weight_version >= version:
            return True
    return False


def seen_versions(observations: Path) -> list[int]:
    try:
        lines = observations.read_text().splitlines()
    except FileNotFoundError:
        return []
    return [json.loads(line)["weight_version"] for line in lines if line.endswith("}")]


async def worked_as_own_redis_users(out: str, redis_config: RedisConfig) -> None:
    """Every service of the run logged in to Redis as its own ACL user (the rules a deployment renders), none was
    refused anything, and the users are gone after the stop."""
    said = re.search(r"its own ACL user: (run-[0-9a-f]+-)<service>", out)
    assert said, out[-2000:]
    admin = redis_client(redis_config.url)
    try:

        def text(value: object) -> str:
            return value.decode() if isinstance(value, bytes) else str(value)

        refused = [e for e in await admin.acl_log() if text(e.get("username", "")).startswith(said.group(1))]
        assert refused == [], refused
        assert [u for u in map(text, await admin.acl_users()) if u.startswith(said.group(1))] == []
    finally:
        await admin.aclose()


async def test_run_serves_shows_progress_learns_reloads_and_stops_cleanly(
    kafka: KafkaConfig, redis_config: RedisConfig, smollm2_path: Path, tmp_path: Path
) -> None:
    """``make run``'s job in short: ``turnstream run --simulate 2`` with batches of 4 samples (half the simulated
    sessions without session headers, as a stock client). Every service starts; turns sent through the proxy
    show in the live progress; at least two weight versions are published and loaded by SGLang, and later turns
    carry the newer version, in what the simulated users saw and in the recorded turns; the console shows it all
    in a browser; SIGTERM stops it all cleanly (exit code 0, no process left). One run does all of it: each
    starts two SGLang servers, minutes on two cores. (A SIGKILL of the run leaving no orphan: test_launch.py.)"""
    run_dir = tmp_path / "run"
    proxy_port, engine_ports = free_port(), (free_port(), free_port())
    proc = start_run(
        kafka, redis_config, smollm2_path, tmp_path, run_dir, proxy_port, "--simulate", "2",
        TURNSTREAM_TRAINER_ROLLOUT_BATCH_SIZE="4", TURNSTREAM_EVAL_MAX_TOKENS="8",
        TURNSTREAM_RUN_ENGINE_PORT=str(engine_ports[0]), TURNSTREAM_RUN_TEACHER_ENGINE_PORT=str(engine_ports[1]),
    )  # fmt: skip
    try:
        wait_status(run_dir, proc, lambda s: s["down"] == [], timeout=600)
        children = psutil.Process(proc.pid).children(recursive=True)
        assert (
            stat.S_IMODE(run_dir.stat().st_mode) == 0o700
        )  # its logs and the simulated users' conversations
        assert len(children) >= 9  # the nine services (SGLang and torch add helpers)
        # The run made the proxy a key and printed it; without it the proxy answers 401.
        key = re.search(r'api_key="([^"<]+)"', (run_dir / "run.out").read_text())
        assert key, (run_dir / "run.out").read_text()[-2000:]
        base_url = f"http://127.0.0.1:{proxy_port}/v1"
        assert httpx.get(base_url + "/models", timeout=30).status_code == 401
        # Both SGLang servers take the run's keys (issue 32, item 3): nothing without one, and their admin routes
        # (here a weight update from any path) only with the admin key, which only the proxy holds.
        api_key, admin_key = engine_keys()
        for port in engine_ports:
            engine_url = f"http://127.0.0.1:{port}"
            update = {"model_path": str(tmp_path), "weight_version": "9"}
            for engine_key in (None, api_key):
                auth = {"Authorization": f"Bearer {engine_key}"} if engine_key else {}
                r = httpx.post(
                    engine_url + "/update_weights_from_disk", json=update, headers=auth, timeout=30
                )
                assert r.status_code == 401, (port, engine_key is None, r.text)
            assert httpx.get(engine_url + "/v1/models", timeout=30).status_code == 401
            auth = {"Authorization": f"Bearer {api_key}"}
            assert httpx.get(engine_url + "/v1/models", headers=auth, timeout=30).status_code == 200
            auth = {"Authorization": f"Bearer {admin_key}"}
            assert httpx.get(engine_url + "/v1/models", headers=auth, timeout=30).status_code == 401
        client = openai.OpenAI(base_url=base_url, api_key=key.group(1))
        for question in ("What is 2+2?", "And 3+3?", "Thanks!"):
            client.chat.completions.create(
                model="policy",
                messages=[{"role": "user", "content": question}],
                max_tokens=8,
                extra_headers={"X-Session-Id": "run-test"},
            )
        wait_status(run_dir, proc, lambda s: s["turns"] >= 3 and s["paired"] >= 2, timeout=120)
        assert "turns " in (run_dir / "run.out").read_text()  # the live line, written for a non-terminal
        wait_status(run_dir, proc, lambda s: s["serving_version"] >= 2, timeout=900)
        # Requests in flight while the engine loaded v2 were still answered by v1: wait until a simulated user's
        # turn answered by v2 is recorded (the user has its answer then; observations.jsonl is rewritten only
        # every 30 s, and at the stop).
        deadline = time.monotonic() + 300
        while not await simulated_turn_at(kafka, 2):
            assert proc.poll() is None and time.monotonic() < deadline, "no simulated user was answered by v2"
            await asyncio.sleep(2)
        # The console, in Chromium, on the live pipeline (tests/browser.py says what it checks).
        banner = (run_dir / "run.out").read_text()
        console = re.search(r"Console: (http://127\.0\.0\.1:\d+)/login\?token=(\S+)", banner)
        assert console, banner[-2000:]
        taught, *_ = [r.event async for r in read_topic(kafka, TEACHER)]
        (turn,) = [r.event async for r in read_topic(kafka, TURNS) if r.event.turn_id == taught.turn_id]
        votes = [r.event async for r in read_topic(kafka, JUDGMENTS) if r.event.turn_id == taught.turn_id]
        shots = os.environ.get("TURNSTREAM_SCREENSHOTS")
        await check_console(
            console.group(1), console.group(2), turn, taught, votes, Path(shots) if shots else None
        )
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0, "a clean stop"
        deadline = time.monotonic() + 60
        while True:
            alive = [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
            if not alive or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert alive == [], f"left behind: {alive}"
        names = [s.name for s in plan(load_config(env={}), str(smollm2_path))]
        assert all((run_dir / f"{name}.log").exists() for name in names)  # one log per service
        await worked_as_own_redis_users((run_dir / "run.out").read_text(), redis_config)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    versions = seen_versions(run_dir / "simulation" / "observations.jsonl")
    assert versions[0] == 0 and max(versions) >= 2, versions
    summary = json.loads((run_dir / "simulation" / "summary.json").read_text())
    assert summary["first"]["weight_version"] == 0 and summary["responses"] == len(versions)
    assert (run_dir / "simulation" / "learning.png").read_bytes()[:4] == b"\x89PNG"
    recorded = [r.event.weight_version async for r in read_topic(kafka, TURNS)]
    assert min(recorded) == 0 and max(recorded) >= 2
    # The simulated users send content-part lists, as the OpenClaw app does: the teacher renders them (it used to
    # dead-letter every such hint, and the dispatcher then dropped the turn an hour later).
    assert [r.event async for r in read_topic(kafka, DEADLETTER)] == []
    listed = {
        r.event.turn_id
        async for r in read_topic(kafka, TURNS)
        if any(isinstance(m.content, list) for m in r.event.messages)
    }
    distilled = [r.event async for r in read_topic(kafka, SAMPLES) if r.event.teacher_logprobs is not None]
    assert any(s.sample_id in listed and s.kind in ("opd+rl", "opd-only") for s in distilled), distilled
    # Half the simulated sessions are sent as a stock client sends them, without session headers: the proxy found
    # their sessions (several turns under one generated id), and the trainer learned from them.
    anon: dict[str, set[int]] = {}
    async for r in read_topic(kafka, TURNS):
        if r.event.session_id.startswith("anon-"):
            anon.setdefault(r.event.session_id, set()).add(r.event.turn_index)
    assert any(len(indexes) >= 2 for indexes in anon.values()), anon
    trained = {sid async for r in read_topic(kafka, WEIGHTS) for sid in r.event.sample_ids}
    from_stock = [r.event async for r in read_topic(kafka, SAMPLES) if r.event.session_id in anon]
    assert any(s.sample_id in trained for s in from_stock), (len(from_stock), len(trained))
    # The held-out evaluation runs beside the pipeline: the starting weights first (the reloader waits for it),
    # then a version the engine served later, never one twice; its questions never become traffic.
    evaluated = [r.event.version async for r in read_topic(kafka, EVALS)]
    assert min(evaluated) == 0 and len(evaluated) >= 2 and len(set(evaluated)) == len(evaluated), evaluated
    held = set(heldout_questions())
    asked = {str(m.content) async for r in read_topic(kafka, TURNS) for m in r.event.messages}
    assert not any(q in text for q in held for text in asked)

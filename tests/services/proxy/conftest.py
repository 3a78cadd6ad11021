from __future__ import annotations

import asyncio
import itertools
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from runtime.configuration.config import Config, KafkaConfig, RedisConfig
from runtime.process.launch import ServiceProcess
from runtime.process.ports import free_port
from schemas import PairedTurn, Turn
from schemas.topics import TURNS, TURNS_PAIRED
from services.proxy.replicas import first_choice, routing_secret
from tests.kafka_wait import wait_for_events
from tests.metrics import scraped

REPO = Path(__file__).resolve().parents[3]


class ProxyProcess(ServiceProcess):
    """``turnstream proxy`` in a subprocess, configured through TURNSTREAM_* variables as a user would; its own
    spool (one per process) and a log beside the test's files."""

    def __init__(self, env: dict[str, str]) -> None:
        port = free_port()
        base = Path(env["TURNSTREAM_PROXY_SPOOL_DIR"]).parent
        self.logfile = open(base / f"proxy-{port}.log", "w")
        env = {
            **env,
            "TURNSTREAM_PROXY_PORT": str(port),
            "TURNSTREAM_PROXY_SPOOL_DIR": str(base / f"spool-{port}"),
        }
        # /metrics needs the key when there is one: then ready once /healthz answers (the engine is up too).
        keyed = env.get("TURNSTREAM_PROXY_API_KEY") or env.get("TURNSTREAM_PROXY_KEYS_FILE")
        ready = "/healthz" if keyed else "/metrics"
        super().__init__(
            ["proxy"], port=port, ready_path=ready, env=env, log=self.logfile, startup_timeout_s=60
        )

    def stop(self) -> None:
        super().stop()
        self.logfile.close()


@pytest.fixture
def proxy(proxy_env: dict[str, str]) -> Iterator[ProxyProcess]:
    p = ProxyProcess(proxy_env)
    yield p
    p.stop()


def routing_key(env: dict[str, str]) -> bytes:
    """The routing hash's key of a proxy started with ``env`` (``TURNSTREAM_*``), as it derives it."""
    return routing_secret(
        env.get("TURNSTREAM_PROXY_ROUTING_SECRET"),
        env.get("TURNSTREAM_ENGINE_ADMIN_API_KEY"),
        env.get("TURNSTREAM_ENGINE_API_KEY"),
    )


def spread_sessions(prefix: str, replicas: list[str], each: int, secret: bytes) -> list[str]:
    """Session ids, ``each`` of which the router sends to every one of ``replicas`` (``host:port`` names) when
    they are equally loaded, for a proxy whose routing key is ``secret`` (``routing_key``): a test that needs
    users on every replica does not depend on where the hash of this run's ports puts a handful of names."""
    homes: dict[str, list[str]] = {name: [] for name in replicas}
    for i in itertools.count():
        session = f"{prefix}{i}"
        home = homes[first_choice(session, replicas, secret)]
        if len(home) < each:
            home.append(session)
        if all(len(h) == each for h in homes.values()):
            return [s for pair in zip(*homes.values(), strict=True) for s in pair]
    raise AssertionError("unreachable")


def assert_still_serving(base_url: str) -> None:
    """The proxy answers a plain chat request (after one it refused)."""
    ok = httpx.post(
        base_url + "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "still there?"}], "max_tokens": 1},
        timeout=60,
    )
    assert ok.status_code == 200, ok.text[:300]


async def wait_for_turns(kafka: KafkaConfig, count: int, timeout: float = 60.0) -> list[Turn]:
    """All turns of the namespace, once at least ``count`` are there."""
    return await wait_for_events(kafka, TURNS, lambda turns: len(turns) >= count, timeout)


async def pair_all(config: Config, expect: int, timeout: float = 60.0) -> list[PairedTurn]:
    """Run the pairer on the config's namespace until ``expect`` pairs exist; returns them all."""
    from services.pairer.worker import run_pairer

    stop = asyncio.Event()
    task = asyncio.create_task(run_pairer(config, install_signals=False, stop=stop))
    try:
        return await wait_for_events(
            config.kafka, TURNS_PAIRED, lambda paired: len(paired) >= expect, timeout
        )
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)


class StubProxy:
    """bench/stub_engine.py behind ``turnstream proxy`` (recording into the test's namespace). ``close`` checks
    that every main turn served was recorded and that nothing reached the unexpected-error handler."""

    def __init__(
        self,
        kafka: KafkaConfig,
        redis_config: RedisConfig,
        tmp_path: Path,
        stub_args: tuple[str, ...] = (),
        **env: str,
    ) -> None:
        port = free_port()
        self.stub = ServiceProcess(
            ["--port", str(port), "--latency-ms", "1", *stub_args],
            port=port,
            ready_path="/health",
            startup_timeout_s=30,
            program=[sys.executable, str(REPO / "bench/stub_engine.py")],
        )
        self.proxy = ProxyProcess(
            {
                **kafka.client_env(),
                "TURNSTREAM_REDIS_URL": redis_config.url,
                "TURNSTREAM_REDIS_KEY_PREFIX": redis_config.key_prefix,
                "TURNSTREAM_ENGINE_URL": f"http://127.0.0.1:{port}",
                "TURNSTREAM_PROXY_SPOOL_DIR": str(tmp_path / "spool"),
                "TURNSTREAM_PROXY_WEIGHTS_ROOT": str(tmp_path / "weights"),
                "TURNSTREAM_PROXY_MAX_BODY_BYTES": "65536",
                **env,
            }
        )
        self.url = self.proxy.url
        key = env.get("TURNSTREAM_PROXY_API_KEY")
        self.auth = {"Authorization": f"Bearer {key}"} if key else {}

    def close(self, dropped: int = 0) -> str:
        """Stop both; returns the proxy's log. Every main turn served was recorded but ``dropped`` (counted)."""
        try:
            assert scraped(self.url, "turnstream_proxy_turns_dropped_total", headers=self.auth) == dropped
        finally:
            self.proxy.stop()
            self.stub.stop()
        log = Path(self.proxy.logfile.name).read_text()
        assert "Traceback" not in log and "unexpected" not in log.lower(), log[-4000:]
        return log


@pytest.fixture
def stub_proxy(kafka: KafkaConfig, redis_config: RedisConfig, tmp_path: Path) -> Iterator[StubProxy]:
    proxy = StubProxy(kafka, redis_config, tmp_path)
    yield proxy
    proxy.close()


def check(r: httpx.Response) -> None:
    """Never a 5xx; an error is OpenAI's shape: {"error": {"message": str, "type": str, "param", "code"}}."""
    assert r.status_code < 500, (r.status_code, r.text[:500])
    if r.status_code != 200:
        error = r.json()["error"]
        assert isinstance(error["message"], str) and error["message"]
        assert isinstance(error["type"], str) and "param" in error and "code" in error

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from runtime.configuration.config import Config, KafkaConfig
from runtime.process.launch import ServiceProcess, free_port
from schemas import PairedTurn, Turn
from schemas.topics import TURNS, TURNS_PAIRED
from tests.kafka_wait import wait_for_events


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

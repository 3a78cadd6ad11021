from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from schemas import PairedTurn, Turn
from schemas.topics import TURNS, TURNS_PAIRED
from services.bus import read_topic
from services.config import Config, KafkaConfig, RedisConfig
from services.engine.launch import EngineProcess, free_port


class ProxyProcess:
    """``turnstream proxy`` in a subprocess, configured through TURNSTREAM_* variables as a user would."""

    def __init__(self, env: dict[str, str]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        spool = Path(env["TURNSTREAM_PROXY_SPOOL_DIR"]).parent / f"spool-{self.port}"
        self.env = {
            **os.environ,
            **env,
            "TURNSTREAM_PROXY_PORT": str(self.port),
            "TURNSTREAM_LOGGING_FORMAT": "text",
            "TURNSTREAM_PROXY_SPOOL_DIR": str(spool),
        }
        self.log = open(Path(env["TURNSTREAM_PROXY_SPOOL_DIR"]).parent / f"proxy-{self.port}.log", "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "services.cli", "proxy"],
            env=self.env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 60
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"proxy exited with {self.proc.returncode}; log: {self.log.name}")
            try:
                httpx.get(self.url + "/metrics", timeout=1)
                return
            except httpx.HTTPError:
                if time.monotonic() > deadline:
                    raise TimeoutError("proxy did not start") from None
                time.sleep(0.2)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


@pytest.fixture
def proxy_env(
    kafka: KafkaConfig, redis_config: RedisConfig, engine: EngineProcess, tmp_path: Path
) -> dict[str, str]:
    return {
        "TURNSTREAM_KAFKA_BOOTSTRAP": kafka.bootstrap,
        "TURNSTREAM_KAFKA_NAMESPACE": kafka.namespace,
        "TURNSTREAM_REDIS_URL": redis_config.url,
        "TURNSTREAM_REDIS_KEY_PREFIX": redis_config.key_prefix,
        "TURNSTREAM_ENGINE_URL": engine.url,
        "TURNSTREAM_PROXY_SPOOL_DIR": str(tmp_path / "spool"),
        "TURNSTREAM_PROXY_WEIGHTS_ROOT": str(tmp_path / "weights"),
    }


@pytest.fixture
def proxy(proxy_env: dict[str, str]) -> Iterator[ProxyProcess]:
    p = ProxyProcess(proxy_env)
    yield p
    p.stop()


async def wait_for_turns(kafka: KafkaConfig, count: int, timeout: float = 60.0) -> list[Turn]:
    """All turns of the namespace, once at least ``count`` are there."""
    deadline = time.monotonic() + timeout
    while True:
        turns = [r.event async for r in read_topic(kafka, TURNS)]
        if len(turns) >= count or time.monotonic() > deadline:
            return turns
        await asyncio.sleep(0.3)


async def pair_all(config: Config, expect: int, timeout: float = 60.0) -> list[PairedTurn]:
    """Run the pairer on the config's namespace until ``expect`` pairs exist; returns them all."""
    from services.proxy.pairer import run_pairer

    stop = asyncio.Event()
    task = asyncio.create_task(run_pairer(config, install_signals=False, stop=stop))
    deadline = time.monotonic() + timeout
    try:
        while True:
            paired = [r.event async for r in read_topic(config.kafka, TURNS_PAIRED)]
            if len(paired) >= expect or time.monotonic() > deadline:
                return paired
            await asyncio.sleep(0.3)
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)

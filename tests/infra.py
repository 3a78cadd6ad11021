"""Finds or starts the real Kafka broker and Redis server for the test run.

Order: ``TURNSTREAM_KAFKA_BOOTSTRAP`` / ``TURNSTREAM_REDIS_URL`` when set; else testcontainers (``apache/kafka``,
``redis``) when a Docker daemon answers; else the repository's scripts (Kafka from Maven Central, Debian's
redis-server) on dedicated test ports, started once per run and stopped at its end.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TEST_KAFKA_PORT = int(os.environ.get("TURNSTREAM_TEST_KAFKA_PORT", "19092"))
TEST_REDIS_PORT = int(os.environ.get("TURNSTREAM_TEST_REDIS_PORT", "16379"))


@dataclass
class Service:
    address: str
    origin: str
    """``env``, ``testcontainers`` or ``script``."""
    stop: Callable[[], None] = field(default=lambda: None)


def docker_available() -> bool:
    try:
        import docker

        docker.from_env(timeout=3).ping()
        return True
    except Exception:
        return False


def _script(name: str, action: str, env: dict[str, str]) -> None:
    subprocess.run(["bash", str(REPO / "scripts" / name), action], check=True, env={**os.environ, **env})


def script_output(name: str, *args: str) -> str:
    """What ``scripts/<name> <args>`` prints (it must succeed)."""
    done = subprocess.run(
        ["bash", str(REPO / "scripts" / name), *args], check=True, capture_output=True, text=True
    )
    return done.stdout.strip()


def kafka_script_env() -> dict[str, str]:
    return {"KAFKA_PORT": str(TEST_KAFKA_PORT), "KAFKA_CONTROLLER_PORT": str(TEST_KAFKA_PORT + 1)}


def start_kafka() -> Service:
    if bootstrap := os.environ.get("TURNSTREAM_KAFKA_BOOTSTRAP"):
        return Service(bootstrap, "env")
    if docker_available():
        from testcontainers.kafka import KafkaContainer

        container = KafkaContainer("apache/kafka:4.1.1").with_kraft()
        container.start()
        return Service(container.get_bootstrap_server(), "testcontainers", container.stop)
    env = kafka_script_env()
    # The test broker is disposable: every test works in a namespace of its own, so a broker kept from an earlier
    # run (TURNSTREAM_KEEP_SERVICES) is reused, and otherwise it starts on empty storage. Kept storage grows by
    # every test's topics and, after a few hundred runs, makes the broker's start outlast its timeout.
    status = subprocess.run(
        ["bash", str(REPO / "scripts/kafka.sh"), "status"], env={**os.environ, **env}, capture_output=True
    )
    if status.returncode != 0:
        _script("kafka.sh", "reset", env)
    _script("kafka.sh", "start", env)
    return Service(f"127.0.0.1:{TEST_KAFKA_PORT}", "script", lambda: _script("kafka.sh", "reset", env))


def start_redis() -> Service:
    if url := os.environ.get("TURNSTREAM_REDIS_URL"):
        return Service(url, "env")
    if docker_available():
        from testcontainers.redis import RedisContainer

        container = RedisContainer("redis:7")
        container.start()
        host, port = container.get_container_host_ip(), container.get_exposed_port(6379)
        return Service(f"redis://{host}:{port}/0", "testcontainers", container.stop)
    env = {"REDIS_PORT": str(TEST_REDIS_PORT)}
    _script("redis.sh", "start", env)
    return Service(
        f"redis://127.0.0.1:{TEST_REDIS_PORT}/0", "script", lambda: _script("redis.sh", "stop", env)
    )

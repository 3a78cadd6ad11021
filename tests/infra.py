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

from runtime.process.ports import free_port, free_port_block

REPO = Path(__file__).resolve().parent.parent
TEST_KAFKA_PORT = int(os.environ.get("TURNSTREAM_TEST_KAFKA_PORT", "19092"))
TEST_REDIS_PORT = int(os.environ.get("TURNSTREAM_TEST_REDIS_PORT", "16379"))


@dataclass
class Service:
    address: str
    origin: str
    """``env``, ``testcontainers`` or ``script``."""
    stop: Callable[[], None] = field(default=lambda: None)
    script_env: dict[str, str] = field(default_factory=dict)
    """For ``script``: the settings its script takes (``KAFKA_PORT``, ``REDIS_PORT``), to stop and start it again."""


def docker_available() -> bool:
    try:
        import docker

        docker.from_env(timeout=3).ping()
        return True
    except Exception:
        return False


def _script(name: str, action: str, env: dict[str, str]) -> None:
    subprocess.run(["bash", str(REPO / "scripts" / name), action], check=True, env={**os.environ, **env})


def script_output(name: str, *args: str, env: dict[str, str] | None = None) -> str:
    """What ``scripts/<name> <args>`` prints (it must succeed)."""
    done = subprocess.run(
        ["bash", str(REPO / "scripts" / name), *args],
        check=True,
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
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
    # The test broker is disposable: every test works in a namespace of its own. One already running (kept from an
    # earlier run by TURNSTREAM_KEEP_SERVICES, or another run's at this moment) is used and left running; one this
    # run starts, starts on empty storage (kept storage grows by every test's topics and, after a few hundred runs,
    # makes the broker's start outlast its timeout) and is removed at the end.
    if _running("kafka.sh", env):
        return Service(f"127.0.0.1:{TEST_KAFKA_PORT}", "script", script_env=env)
    _script("kafka.sh", "reset", env)
    _script("kafka.sh", "start", env)
    return Service(f"127.0.0.1:{TEST_KAFKA_PORT}", "script", lambda: _script("kafka.sh", "reset", env), env)


def _running(script: str, env: dict[str, str]) -> bool:
    status = subprocess.run(
        ["bash", str(REPO / "scripts" / script), "status"], env={**os.environ, **env}, capture_output=True
    )
    return status.returncode == 0


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
    if _running("redis.sh", env):  # kept, or another run's: used and left running
        _script("redis.sh", "start", env)  # refuses one started without the script's users
        return Service(script_output("redis.sh", "url", env=env), "script", script_env=env)
    _script("redis.sh", "start", env)
    url = script_output("redis.sh", "url", env=env)  # as its admin: the default user is off
    return Service(url, "script", lambda: _script("redis.sh", "stop", env), env)


def start_private_kafka(sasl: bool = False) -> Service:
    """A broker of the caller's own, on empty storage and free ports, for a test that stops and restarts its broker:
    the run's shared one goes on serving every other test meanwhile (the other lane's among them). ``sasl``: as the
    deployments run it (SCRAM logins, ACLs; ``script_output("kafka.sh", "password", env=service.script_env)`` is
    its operator's password)."""
    base = free_port_block(2)
    env = {
        "KAFKA_PORT": str(base),
        "KAFKA_CONTROLLER_PORT": str(base + 1),
        "KAFKA_SASL": "1" if sasl else "0",
    }
    _script("kafka.sh", "reset", env)
    _script("kafka.sh", "start", env)
    return Service(f"127.0.0.1:{base}", "script", lambda: _script("kafka.sh", "reset", env), env)


def start_private_redis() -> Service:
    """A Redis server of the caller's own (a free port, empty), for a test that stops and restarts it."""
    env = {"REDIS_PORT": str(free_port())}
    _script("redis.sh", "reset", env)
    _script("redis.sh", "start", env)
    url = script_output("redis.sh", "url", env=env)
    return Service(url, "script", lambda: _script("redis.sh", "reset", env), env)

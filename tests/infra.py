"""Finds or starts the real Kafka broker and Redis server for the test run.

Order: ``TURNSTREAM_KAFKA_BOOTSTRAP`` / ``TURNSTREAM_REDIS_URL`` when set; else testcontainers (``apache/kafka``,
``redis``) when a Docker daemon answers; else the repository's scripts (Kafka from Maven Central, Debian's
redis-server) on dedicated test ports, started once per run and stopped at its end.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from runtime.configuration.config import KAFKA_LOGIN_FIELDS, KafkaConfig
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
    login: dict[str, str] = field(default_factory=dict)
    """A Kafka broker's: how its operator logs in (``KafkaConfig``'s security fields; empty in plain text)."""

    def kafka(self) -> KafkaConfig:
        """This broker, logging in as its operator."""
        return KafkaConfig(bootstrap=self.address, **self.login)  # type: ignore[arg-type]


LOGIN_ENV = "TURNSTREAM_TEST_KAFKA_LOGIN"
"""How the test run's broker is logged in to (JSON), for the lanes' workers beside its address: not as
``TURNSTREAM_KAFKA_*`` variables, which every service a test starts would inherit (those on a broker of their own
too)."""


def moved_to(config: KafkaConfig, broker: Service) -> KafkaConfig:
    """``config`` (its namespace and settings) on ``broker``, logging in as that broker's operator."""
    login = {name: getattr(broker.kafka(), name) for name in ("bootstrap", *KAFKA_LOGIN_FIELDS)}
    return msgspec.structs.replace(config, **login)


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


def operator_login(script_env: dict[str, str], script: str = "kafka.sh") -> dict[str, str]:
    """The operator's login to ``script``'s broker (or cluster) at ``script_env``'s ports: SCRAM as ``admin`` where
    it takes SASL logins, nothing for one in plain text (kept from a run before, formatted so)."""
    password = subprocess.run(
        ["bash", str(REPO / "scripts" / script), "password"],
        env={**os.environ, **script_env},
        capture_output=True,
        text=True,
    )
    if password.returncode != 0:
        return {}
    return {
        "security_protocol": "SASL_PLAINTEXT",
        "sasl_mechanism": "SCRAM-SHA-512",
        "sasl_username": "admin",
        "sasl_password": password.stdout.strip(),
    }


def _env_login() -> dict[str, str]:
    """The login to a broker named by ``TURNSTREAM_KAFKA_BOOTSTRAP``: the lanes' controller's (``LOGIN_ENV``), else
    the ``TURNSTREAM_KAFKA_*`` security variables that are set."""
    if shared := os.environ.get(LOGIN_ENV):
        return dict(json.loads(shared))
    fields = ("security_protocol", "sasl_mechanism", "sasl_username", "sasl_password")
    return {f: os.environ[v] for f in fields if (v := f"TURNSTREAM_KAFKA_{f.upper()}") in os.environ}


def start_kafka() -> Service:
    """The run's shared broker, as the deployments run it: SASL/SCRAM logins and ACLs (every test logs in as its
    operator; tests/runtime/security/test_kafka_users.py checks the services' own users)."""
    if bootstrap := os.environ.get("TURNSTREAM_KAFKA_BOOTSTRAP"):
        return Service(bootstrap, "env", login=_env_login())
    if docker_available():
        from testcontainers.kafka import KafkaContainer

        container = KafkaContainer("apache/kafka:4.1.1").with_kraft()
        container.start()
        return Service(container.get_bootstrap_server(), "testcontainers", container.stop)
    env = {**kafka_script_env(), "KAFKA_SASL": "1"}
    # The test broker is disposable: every test works in a namespace of its own. One already running (kept from an
    # earlier run by TURNSTREAM_KEEP_SERVICES, or another run's at this moment) is used and left running; one this
    # run starts, starts on empty storage (kept storage grows by every test's topics and, after a few hundred runs,
    # makes the broker's start outlast its timeout) and is removed at the end.
    address = f"127.0.0.1:{TEST_KAFKA_PORT}"
    if _running("kafka.sh", env):
        return Service(address, "script", script_env=env, login=operator_login(env))
    _script("kafka.sh", "reset", env)
    _script("kafka.sh", "start", env)
    stop = lambda: _script("kafka.sh", "reset", env)  # noqa: E731
    return Service(address, "script", stop, env, operator_login(env))


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


def start_private_kafka() -> Service:
    """A broker of the caller's own, on empty storage and free ports, for a test that stops and restarts its broker:
    the run's shared one goes on serving every other test meanwhile (the other lane's among them). As the
    deployments run it (SCRAM logins, ACLs); ``moved_to`` puts a test's settings on it."""
    base = free_port_block(2)
    env = {"KAFKA_PORT": str(base), "KAFKA_CONTROLLER_PORT": str(base + 1), "KAFKA_SASL": "1"}
    _script("kafka.sh", "reset", env)
    _script("kafka.sh", "start", env)
    stop = lambda: _script("kafka.sh", "reset", env)  # noqa: E731
    return Service(f"127.0.0.1:{base}", "script", stop, env, operator_login(env))


def start_private_redis() -> Service:
    """A Redis server of the caller's own (a free port, empty), for a test that stops and restarts it."""
    env = {"REDIS_PORT": str(free_port())}
    _script("redis.sh", "reset", env)
    _script("redis.sh", "start", env)
    url = script_output("redis.sh", "url", env=env)
    return Service(url, "script", lambda: _script("redis.sh", "reset", env), env)

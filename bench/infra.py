"""Kafka and Redis for benchmarks: the ones named by TURNSTREAM_KAFKA_BOOTSTRAP / TURNSTREAM_REDIS_URL, else
started from scripts/ on ports of their own (29092, 26379) so that a benchmark never disturbs a test run."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

Started = list[tuple[str, dict[str, str]]]


def start_kafka(started: Started) -> str:
    bootstrap = os.environ.get("TURNSTREAM_KAFKA_BOOTSTRAP")
    if bootstrap:
        return bootstrap
    env = {"KAFKA_PORT": "29092", "KAFKA_CONTROLLER_PORT": "29093"}
    subprocess.run(["bash", str(REPO / "scripts/kafka.sh"), "start"], check=True, env={**os.environ, **env})
    started.append(("kafka.sh", env))
    return "127.0.0.1:29092"


def start_sasl_kafka(started: Started) -> tuple[str, str]:
    """A broker as the deployments run it (SCRAM logins, ACLs), on ports of its own: its bootstrap and its
    operator's (``admin``) password."""
    env = {"KAFKA_PORT": "29192", "KAFKA_CONTROLLER_PORT": "29193", "KAFKA_SASL": "1"}
    subprocess.run(["bash", str(REPO / "scripts/kafka.sh"), "start"], check=True, env={**os.environ, **env})
    started.append(("kafka.sh", env))
    password = subprocess.run(
        ["bash", str(REPO / "scripts/kafka.sh"), "password"],
        check=True,
        capture_output=True,
        text=True,
        env={**os.environ, **env},
    )
    return "127.0.0.1:29192", password.stdout.strip()


def start_redis(started: Started) -> str:
    url = os.environ.get("TURNSTREAM_REDIS_URL")
    if url:
        return url
    env = {"REDIS_PORT": "26379"}
    subprocess.run(["bash", str(REPO / "scripts/redis.sh"), "start"], check=True, env={**os.environ, **env})
    started.append(("redis.sh", env))
    url = subprocess.run(  # as its admin: the default user may only PING
        ["bash", str(REPO / "scripts/redis.sh"), "url"],
        check=True,
        capture_output=True,
        text=True,
        env={**os.environ, **env},
    )
    return url.stdout.strip()


def stop_started(started: Started) -> None:
    for script, env in started:
        subprocess.run(
            ["bash", str(REPO / "scripts" / script), "stop"], env={**os.environ, **env}, capture_output=True
        )

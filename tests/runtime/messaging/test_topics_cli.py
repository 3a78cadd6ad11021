"""``turnstream topics create|describe`` against the real broker, run as a user runs it."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import pytest

from schemas import ALL_TOPICS
from tests.infra import Service

pytestmark = pytest.mark.integration


def turnstream(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "services.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "TURNSTREAM_LOGGING_FORMAT": "text", **(env or {})},
    )


def test_create_is_idempotent_and_describe_reports_specs(kafka_service: Service) -> None:
    ns = f"cli-{uuid.uuid4().hex[:8]}"
    env = kafka_service.kafka().client_env()
    first = turnstream("topics", "create", "--namespace", ns, "--partitions", "2", env=env)
    assert first.returncode == 0, first.stderr
    lines = first.stdout.splitlines()
    assert len(lines) == len(ALL_TOPICS)
    assert [line.split()[1] for line in lines] == ["created"] * len(ALL_TOPICS)

    again = turnstream("topics", "create", "--namespace", ns, env=env)
    assert again.returncode == 0, again.stderr
    assert [line.split()[1] for line in again.stdout.splitlines()] == ["exists"] * len(ALL_TOPICS)
    assert "partitions=2" in again.stdout

    described = turnstream("topics", "describe", "--namespace", ns, env=env)
    assert described.returncode == 0, described.stderr
    rows = {line.split()[0]: line for line in described.stdout.splitlines()}
    assert set(rows) == {f"{ns}.{spec.base}" for spec in ALL_TOPICS}
    assert "partitions=2" in rows[f"{ns}.turns"] and "retention.ms=-1" in rows[f"{ns}.turns"]
    assert "partitions=1" in rows[f"{ns}.weights"] and "cleanup.policy=compact" in rows[f"{ns}.weights"]
    # One broker: one copy, and a write needs only it.
    assert "replicas=1" in rows[f"{ns}.turns"] and "min.insync.replicas=1" in rows[f"{ns}.turns"]


@pytest.mark.parametrize(
    ("brokers", "factor", "insync", "expected"),
    [
        (1, 0, 0, (1, 1)),
        (2, 0, 0, (2, 1)),
        (3, 0, 0, (3, 2)),
        (5, 0, 0, (3, 2)),
        (5, 5, 3, (5, 3)),
        (3, 2, 0, (2, 1)),
    ],
)
def test_replication_follows_the_brokers_the_cluster_has(
    brokers: int, factor: int, insync: int, expected: tuple[int, int]
) -> None:
    from runtime.configuration.config import KafkaConfig

    kafka = KafkaConfig(replication_factor=factor, min_insync_replicas=insync)
    assert kafka.replication(brokers) == expected


def test_more_copies_than_brokers_is_refused() -> None:
    from runtime.configuration.config import KafkaConfig

    with pytest.raises(ValueError, match="3 copies need 3 brokers; the cluster has 2"):
        KafkaConfig(replication_factor=3).replication(2)
    with pytest.raises(ValueError, match="more than the 2 copies"):
        KafkaConfig(replication_factor=2, min_insync_replicas=3).replication(3)


def test_retention_is_set_per_topic_and_applied_to_existing_topics(kafka_service: Service) -> None:
    """Issue 32, item 8: ``turns`` and ``sessions.ended`` were kept forever with no way to say otherwise. Each
    topic's retention is a setting; ``topics create`` applies it to topics that exist already, keeping their
    other settings."""
    ns = f"ret-{uuid.uuid4().hex[:8]}"
    env = kafka_service.kafka().client_env()
    assert turnstream("topics", "create", "--namespace", ns, env=env).returncode == 0
    env["TURNSTREAM_KAFKA_RETENTION_DAYS"] = "turns=365, samples=0.5"
    out = turnstream("topics", "create", "--namespace", ns, env=env)
    assert out.returncode == 0, out.stderr
    rows = {line.split()[0]: line for line in out.stdout.splitlines()}
    assert rows[f"{ns}.turns"].split()[1] == rows[f"{ns}.samples"].split()[1] == "updated"
    assert rows[f"{ns}.judgments"].split()[1] == "exists"
    described = turnstream("topics", "describe", "--namespace", ns, env=env)
    rows = {line.split()[0]: line for line in described.stdout.splitlines()}
    assert f"retention.ms={365 * 24 * 3600 * 1000}" in rows[f"{ns}.turns"]
    assert f"retention.ms={12 * 3600 * 1000}" in rows[f"{ns}.samples"]
    assert f"max.message.bytes={16 * 1024 * 1024}" in rows[f"{ns}.turns"], "the topic's other settings stay"
    assert f"retention.ms={30 * 24 * 3600 * 1000}" in rows[f"{ns}.judgments"]
    again = turnstream("topics", "create", "--namespace", ns, env=env)
    assert [line.split()[1] for line in again.stdout.splitlines()] == ["exists"] * len(ALL_TOPICS)
    fresh = f"ret-{uuid.uuid4().hex[:8]}"  # a new namespace is created with them
    created = turnstream("topics", "create", "--namespace", fresh, env=env)
    assert created.returncode == 0 and f"retention.ms={365 * 24 * 3600 * 1000}" in created.stdout
    for bad in ("weights=3", "tunrs=3", "turns=0", "turns=soon"):
        out = turnstream("config", "show", env={"TURNSTREAM_KAFKA_RETENTION_DAYS": bad})
        assert out.returncode == 2 and "retention_days" in out.stderr, (bad, out.stderr)


def test_describe_of_a_missing_namespace_fails(kafka_service: Service) -> None:
    out = turnstream(
        "topics",
        "describe",
        "--namespace",
        f"none-{uuid.uuid4().hex[:8]}",
        env=kafka_service.kafka().client_env(),
    )
    assert out.returncode == 1
    assert [line.split()[1] for line in out.stdout.splitlines()] == ["missing"] * len(ALL_TOPICS)


def test_wait_returns_once_every_topic_exists_and_redis_answers(
    kafka_service: Service, redis_service: Service
) -> None:
    """What a Kubernetes pod's init container runs (deploy/helm): it holds the service until the topics job has
    made every topic; with Redis unreachable it keeps waiting and says why."""
    ns = f"wait-{uuid.uuid4().hex[:8]}"
    env = {**kafka_service.kafka().client_env(), "TURNSTREAM_REDIS_URL": redis_service.address}
    early = turnstream("topics", "wait", "--namespace", ns, "--timeout", "2", env=env)
    assert early.returncode == 1 and "topics missing" in early.stderr, early.stderr
    waiting = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "topics", "wait", "--namespace", ns, "--timeout", "110"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "TURNSTREAM_LOGGING_FORMAT": "text", **env},
    )
    try:
        assert turnstream("topics", "create", "--namespace", ns, env=env).returncode == 0
        out, err = waiting.communicate(timeout=120)
    finally:
        waiting.kill()
    assert waiting.returncode == 0 and "every topic exists" in out, err
    no_redis = turnstream(
        "topics", "wait", "--namespace", ns, "--timeout", "2",
        env={**env, "TURNSTREAM_REDIS_URL": "redis://127.0.0.1:9/0"},
    )  # fmt: skip
    assert no_redis.returncode == 1 and "Redis" in no_redis.stderr, no_redis.stderr


def test_bad_namespace_and_bad_config_are_clear_errors() -> None:
    out = turnstream("topics", "create", "--namespace", "has space")
    assert out.returncode == 2 and "namespace" in out.stderr
    out = turnstream("config", "show", env={"PRM_M": "zero"})
    assert out.returncode == 2 and "judge.m" in out.stderr and "$PRM_M" in out.stderr
    assert "Traceback" not in out.stderr


def test_replay_says_what_is_wrong_with_its_arguments() -> None:
    out = turnstream("replay")
    assert out.returncode == 2 and "derive,drive,export,import" in out.stderr
    out = turnstream("replay", "derive", "--into", "r1", "--since", "yesterday-ish")
    assert out.returncode == 2 and "neither ISO 8601 nor seconds" in out.stderr
    assert "Traceback" not in out.stderr

"""The Redis ACL users of runtime/security/redis_users.py against a real Redis: the file deployments render loads and
keeps no password; each service's user runs that service's own Redis code and reaches nothing else."""

from __future__ import annotations

import asyncio
import secrets
import subprocess
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from redis.exceptions import AuthenticationError, NoPermissionError

from runtime.configuration.config import KafkaConfig, RedisConfig
from runtime.process.ports import free_port
from runtime.security.erasure.keys import SessionKeys
from runtime.security.redis_users import NAMES, OPERATOR, PROBE, USERS, acl_file, provision, with_user
from runtime.transport.redis_urls import redis_client as connect
from runtime.transport.resp import PipelinedRedis, RedisReplyError
from services.dispatcher.join import JoinStore
from services.proxy.engine_lease import EngineLease
from services.proxy.stored import ResponseStore
from services.proxy.turn_numbers import TurnNumbers

FORBIDDEN = (
    ("FLUSHALL",),
    ("CONFIG", "SET", "appendonly", "no"),
    ("KEYS", "*"),
    ("ACL", "LIST"),
    ("REPLICAOF", "NO", "ONE"),
    ("SCAN", "0"),
    ("CLIENT", "LIST"),
)
"""What no service may run, whatever its keys: each would read or wreck what is not its own."""


def test_the_acl_file_loads_holds_only_hashes_and_keeps_what_scripts_wrote_across_a_restart(
    tmp_path: Path,
) -> None:
    """What compose's ``redis-users`` step and the chart's init container write: Redis 7.0 (Debian's, the oldest
    one run here) starts with it; each user logs in with its password and no other; the file reveals none; nobody
    logs in as the default user and ``probe`` may only PING. And what the services' scripts wrote survives a
    restart: Redis replays its append-only file's transactions with the default user's permissions, so a default
    user restricted (as this file first had it) lost every script's writes at the restart, silently (turn counters
    back at 1: ``tests/test_faults.py::test_redis_restart`` found it)."""
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    passwords = {n: secrets.token_urlsafe(16) for n in NAMES}
    text = acl_file(passwords)
    assert not [p for p in passwords.values() if p in text]
    (tmp_path / "users.acl").write_text(text)
    port = free_port()
    no_retry = Retry(NoBackoff(), 0)  # a refused login is the answer, not a fault to retry

    def login(user: str | None, password: str | None) -> redis.Redis:
        client = redis.Redis(
            port=port, username=user, password=password, lib_name=None, lib_version=None, retry=no_retry
        )
        client.ping()
        return client

    def start() -> subprocess.Popen[bytes]:
        server = subprocess.Popen(
            ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--dir", str(tmp_path),
             "--appendonly", "yes", "--aclfile", str(tmp_path / "users.acl")],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )  # fmt: skip
        deadline = time.monotonic() + 10
        while True:  # until it answers its health check
            try:
                login(PROBE, "any")
                return server
            except redis.ConnectionError:
                assert server.poll() is None, server.stdout.read() if server.stdout else ""
                assert time.monotonic() < deadline
                time.sleep(0.05)

    server = start()
    try:
        with pytest.raises(AuthenticationError):
            login(None, None).get("turnstream:conv:x")
        with pytest.raises(NoPermissionError):
            login(PROBE, "any").get("turnstream:conv:x")
        for user, password in passwords.items():
            if user == "client":  # the Sentinels' user, not the servers'
                continue
            login(user, password).ping()
            with pytest.raises(AuthenticationError):
                login(user, password + "x")
        assert login(OPERATOR, passwords[OPERATOR]).acl_whoami() == OPERATOR

        async def number() -> list[int]:
            url = f"redis://proxy:{passwords['proxy']}@127.0.0.1:{port}/0"
            numbers = TurnNumbers(url, "turnstream:", fences=b"turnstream:dek:")
            try:
                return [await numbers.next("s1") for _ in range(3)]
            finally:
                await numbers.aclose()

        assert asyncio.run(number()) == [1, 2, 3]
        server.terminate()  # a clean stop: the append-only file is flushed
        server.wait(10)
        server = start()
        assert login(OPERATOR, passwords[OPERATOR]).get("turnstream:turns:s1") == b"3"
    finally:
        server.terminate()
        server.wait(10)


@pytest.fixture
async def users(redis_config: RedisConfig) -> AsyncIterator[dict[str, str]]:
    """Every service's user on the test Redis (its key patterns this test's prefix): service -> URL."""
    admin = connect(redis_config.url)
    dek = f"{redis_config.key_prefix}dek:"
    made = await provision(admin, list(USERS), redis_config.key_prefix, dek, f"t{uuid.uuid4().hex[:8]}-")
    yield {s: with_user(redis_config.url, user, password) for s, (user, password) in made.items()}
    await admin.execute_command("ACL", "DELUSER", *(user for user, _ in made.values()))
    await admin.aclose()


async def test_each_service_runs_its_own_redis_code_and_reaches_nothing_else(
    users: dict[str, str], redis_config: RedisConfig, redis_client: aioredis.Redis
) -> None:
    """The proxy numbers turns, stores a sealed answer and holds the reload lease as ``proxy``; the dispatcher joins
    as ``dispatcher``; every worker makes a sealing key and the console reads one but cannot make one; the pairer
    cannot read what the proxy stored nor the proxy the dispatcher's joins; nobody flushes, lists or re-points."""
    prefix = redis_config.key_prefix
    dek = f"{prefix}dek:"

    def kafka(url: str) -> KafkaConfig:
        return KafkaConfig(seal_keys_url=url, seal_keys_prefix=dek)

    numbers = TurnNumbers(users["proxy"], prefix, fences=dek.encode())
    assert [await numbers.next("s1"), await numbers.next("s1")] == [1, 2]
    await numbers.aclose()
    proxy = PipelinedRedis(users["proxy"])
    stored = ResponseStore(proxy, prefix, 60, kafka(users["proxy"]))
    await stored.keep("resp_1", "alice", "s1", [{"role": "user", "content": "hi"}])
    found = await stored.load("resp_1", "alice")
    assert found is not None and found.session == "s1"
    lease = EngineLease(proxy, f"{prefix}reload:lease:http://engine")
    assert await lease.acquire() and await lease.renew()
    await lease.release()
    await proxy.aclose()

    dispatcher = connect(users["dispatcher"])
    joins = JoinStore(dispatcher, prefix, join_ttl_s=60, dedupe_ttl_s=60)
    decision, fields = await joins.add("s1:1", "judge", b"+1", b"turn", time.time())
    assert decision is None and fields["judge"] == b"+1"
    await joins.close("s1:1", "sampled", "s1")
    assert await joins.session_has_sample("s1")

    for service in USERS:
        keys = SessionKeys(PipelinedRedis(users[service]), dek)
        if service == "console":
            assert await keys.for_reading("s1") is not None  # the proxy's, made as it sealed the answer
            with pytest.raises(RedisReplyError, match="NOPERM"):
                await keys.for_writing(f"new-{service}")
        else:
            assert len(await keys.for_writing(f"new-{service}")) == 32
        await keys.redis.aclose()

    pairer = connect(users["pairer"])
    await pairer.set(f"{prefix}pairer:s:s1", b"state")
    for key in (f"{prefix}resp:resp_1", f"{prefix}turns:s1", f"{prefix}disp:t:s1:1"):
        with pytest.raises(NoPermissionError):
            await pairer.get(key)
    judge = connect(users["judge"])
    with pytest.raises(NoPermissionError):
        await judge.set(f"{prefix}disp:done:s2:1", b"sampled")  # a decision made past the judge
    for service in USERS:
        client: aioredis.Redis = connect(users[service])
        for forbidden in FORBIDDEN:
            with pytest.raises(NoPermissionError):
                await client.execute_command(*forbidden)
        await client.aclose()
    for client in (dispatcher, pairer, judge):
        await client.aclose()

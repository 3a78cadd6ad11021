"""Turn numbering against the real Redis server: replicas agree, AUTH/SELECT from the URL, errors surface, a lost
connection is replaced, and a reply whose caller gave up does not shift the next caller's number."""

from __future__ import annotations

import asyncio
import uuid
from urllib.parse import urlsplit, urlunsplit

import pytest
import redis.asyncio as aioredis

from runtime.configuration.config import RedisConfig
from runtime.process.ports import free_port
from runtime.transport.resp import RedisReplyError, command
from services.proxy.turn_numbers import TurnNumbers

pytestmark = pytest.mark.integration


async def test_two_replicas_number_one_session_without_gaps_or_repeats(
    redis_config: RedisConfig, redis_client: aioredis.Redis
) -> None:
    replicas = [TurnNumbers(redis_config.url, redis_config.key_prefix) for _ in range(2)]
    try:
        numbers = await asyncio.gather(*(replicas[i % 2].next("s1") for i in range(200)))
        assert sorted(numbers) == list(range(1, 201))
        assert await replicas[1].next("other") == 1
        # A session end reads the last number without taking one (and without upsetting the pipelined replies).
        assert await replicas[0].current("s1") == 200 and await replicas[1].current("never") == 0
        # The same key redis-py would use: what the proxy always stored.
        assert int(await redis_client.get(f"{redis_config.key_prefix}turns:s1")) == 200
        assert await replicas[0].next("s1") == 201
    finally:
        await asyncio.gather(*(r.aclose() for r in replicas))


async def test_error_replies_raise_and_keep_the_order(
    redis_config: RedisConfig, redis_client: aioredis.Redis
) -> None:
    await redis_client.set(f"{redis_config.key_prefix}turns:text", "not a number")
    numbers = TurnNumbers(redis_config.url, redis_config.key_prefix)
    try:
        results = await asyncio.gather(
            numbers.next("a"), numbers.next("text"), numbers.next("a"), return_exceptions=True
        )
        assert results[0] == 1 and results[2] == 2
        assert isinstance(results[1], RedisReplyError) and "integer" in str(results[1])
    finally:
        await numbers.aclose()


async def test_a_killed_connection_fails_its_callers_and_the_next_call_reconnects(
    redis_config: RedisConfig, redis_client: aioredis.Redis
) -> None:
    numbers = TurnNumbers(redis_config.url, redis_config.key_prefix)
    try:
        assert await numbers.next("k") == 1
        conn = numbers.redis._conn
        assert conn is not None and conn.transport is not None
        host, port = conn.transport.get_extra_info("sockname")[:2]
        assert await redis_client.client_kill(f"{host}:{port}")
        await asyncio.sleep(0.2)
        assert conn.lost
        assert await numbers.next("k") == 2
        assert numbers.redis._conn is not conn
    finally:
        await numbers.aclose()


async def test_user_password_and_db_from_the_url(
    redis_config: RedisConfig, redis_client: aioredis.Redis
) -> None:
    user, password = f"ts-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    await redis_client.acl_setuser(
        user, enabled=True, passwords=[f"+{password}"], keys=["*"], commands=["+@all"]
    )
    parts = urlsplit(redis_config.url)
    base = f"redis://{user}:{{password}}@{parts.hostname}:{parts.port}/3"
    numbers = TurnNumbers(base.format(password=password), redis_config.key_prefix)
    wrong = TurnNumbers(base.format(password="wrong"), redis_config.key_prefix)
    db3 = aioredis.from_url(urlunsplit(parts._replace(path="/3")))  # as the test Redis's operator
    key = f"{redis_config.key_prefix}turns:authed"
    try:
        assert await numbers.next("authed") == 1
        assert await redis_client.get(key) is None  # not in db 0
        assert int(await db3.get(key)) == 1
        with pytest.raises(RedisReplyError):
            await wrong.next("authed")
    finally:
        await db3.delete(key)
        await db3.aclose()
        await redis_client.acl_deluser(user)
        await asyncio.gather(numbers.aclose(), wrong.aclose())


async def test_a_user_whose_acl_allows_only_the_data_keys_numbers_and_resolves_turns(
    redis_config: RedisConfig, redis_client: aioredis.Redis
) -> None:
    """Issue 55, row 8: a service's Redis user may touch only its keys (``~<prefix>*``). The proxy's scripts named
    an empty key when a check did not apply (no fence, no link), which such an ACL refuses (NOPERM): they now pass
    fewer keys instead."""
    from runtime.transport.resp import PipelinedRedis
    from services.proxy.continuity import Continuity

    user, password = f"ts-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    await redis_client.acl_setuser(
        user,
        enabled=True,
        passwords=[f"+{password}"],
        keys=[f"{redis_config.key_prefix}*"],
        commands=["+@all", "-@dangerous"],
    )
    parts = urlsplit(redis_config.url)
    url = f"redis://{user}:{password}@{parts.hostname}:{parts.port}/0"
    numbers = TurnNumbers(url, redis_config.key_prefix)
    links = Continuity(PipelinedRedis(url), redis_config.key_prefix, ttl_s=60)
    try:
        assert await numbers.next("acl") == 1  # no fence here (the data keys' Redis is elsewhere)
        fresh = await links.resolve(links.ask(None, "acl-2"))  # a conversation that continues none
        assert (fresh.how, fresh.turn_index) == ("new", 1)
        await links.release(None, fresh)  # never answered: its number given back
        assert int(await redis_client.get(f"{redis_config.key_prefix}turns:acl-2")) == 0
        with pytest.raises(RedisReplyError, match="NOPERM"):  # and the ACL does hold
            await links.redis.send(command(b"SET", b"elsewhere", b"1"))
    finally:
        await redis_client.acl_deluser(user)
        await asyncio.gather(numbers.aclose(), links.redis.aclose())


async def test_a_reply_that_came_too_late_is_not_given_to_the_next_caller() -> None:
    """A RESP server that answers slowly, in order (as Redis does): the caller that timed out loses its number;
    the next caller gets its own reply, not the late one."""
    port = free_port()
    counter = 0

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal counter
        try:
            while True:
                count = int((await reader.readline())[1:])  # one command: *N, then N bulk strings
                for _ in range(2 * count):
                    await reader.readline()
                counter += 1
                if counter == 1:
                    await asyncio.sleep(0.3)
                writer.write(b":%d\r\n" % counter)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass

    server = await asyncio.start_server(handle, "127.0.0.1", port)
    numbers = TurnNumbers(f"redis://127.0.0.1:{port}/0", "p:")
    try:
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.1):
                await numbers.next("s")
        assert await numbers.next("s") == 2
    finally:
        await numbers.aclose()
        server.close()


async def test_numbering_once_per_nonce_is_idempotent_and_shares_the_counter(
    redis_config: RedisConfig, redis_client: aioredis.Redis
) -> None:
    """The late path (turns served while Redis was away): asking again for one nonce (a resend after a crash,
    from another process too) gets the same number; other nonces and arrival numbering share one counter."""
    a, b = (TurnNumbers(redis_config.url, redis_config.key_prefix) for _ in range(2))
    try:
        assert await a.next("s") == 1
        first, second = uuid.uuid4().bytes, uuid.uuid4().bytes
        assert await a.number_once("s", first) == 2
        assert await b.number_once("s", first) == 2
        assert await a.number_once("s", second) == 3
        assert await b.next("s") == 4
        assert await a.number_once("s", first) == 2
        ttl = await redis_client.ttl(f"{redis_config.key_prefix}turn-nonce:{first.hex()}")
        assert ttl > 86400, "a nonce's number is remembered for as long as a spool may hold the turn"
    finally:
        await a.aclose()
        await b.aclose()


async def test_every_counter_expires_after_its_sessions_last_turn(
    redis_config: RedisConfig, redis_client: aioredis.Redis
) -> None:
    """Issue 32 item 9: ``turns:<session>`` counters lived forever. Each way of taking a number (``next``, the late
    ``number_once``) sets the expiry again; reading the last number (a session's end) creates no key."""
    numbers = TurnNumbers(redis_config.url, redis_config.key_prefix, session_ttl_s=600)
    counters = f"{redis_config.key_prefix}turns:"
    try:
        await (
            redis_client.script_flush()
        )  # as after a Redis restart: EVALSHA answers NOSCRIPT, the script is sent
        assert await numbers.next("ttl-a") == 1
        assert 590 < await redis_client.ttl(counters + "ttl-a") <= 600
        await redis_client.expire(counters + "ttl-a", 5)
        assert await numbers.next("ttl-a") == 2  # a later turn starts the expiry again
        assert 590 < await redis_client.ttl(counters + "ttl-a") <= 600
        assert await numbers.number_once("ttl-b", uuid.uuid4().bytes) == 1
        assert 590 < await redis_client.ttl(counters + "ttl-b") <= 600
        assert await numbers.current("ttl-never") == 0
        assert not await redis_client.exists(counters + "ttl-never")
        assert await numbers.current("ttl-a") == 2
    finally:
        await numbers.aclose()

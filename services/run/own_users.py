"""Each service ``turnstream run`` starts logs in to Redis as an ACL user of its own (runtime/security/redis_users.py),
and to a Kafka that takes SASL logins as a SCRAM user of its own (runtime/security/kafka_users.py), made for this run
as the operator and removed when it stops: the rules a deployment renders are the ones every run works under."""

from __future__ import annotations

import secrets

import msgspec
import redis.asyncio as aioredis

from runtime.configuration.config import Config
from runtime.process.supervisor import Service
from runtime.security import kafka_users
from runtime.security.redis_users import USERS, provision, with_user
from runtime.transport.redis_urls import redis_client


async def give_own_users(config: Config, services: list[Service]) -> tuple[list[Service], list[str]]:
    """``services`` with ``TURNSTREAM_REDIS_URL`` (and the sealing keys' URL, when it is the same Redis) naming
    each one's own user, and the users made. Raises ``redis.RedisError`` when ``redis.url`` may not make users."""
    names = [s.name for s in services if s.name in USERS]
    admin = redis_client(config.redis.url, socket_timeout=10)
    try:
        made = await provision(
            admin,
            names,
            config.redis.key_prefix,
            config.kafka.seal_keys_prefix,
            name_prefix=f"run-{secrets.token_hex(3)}-",
        )
    finally:
        await admin.aclose()
    seal_too = config.kafka.seal_keys_url == config.redis.url
    given = []
    for service in services:
        if service.name in made:
            url = with_user(config.redis.url, *made[service.name])
            env = {**service.env, "TURNSTREAM_REDIS_URL": url}
            if seal_too:
                env["TURNSTREAM_KAFKA_SEAL_KEYS_URL"] = url
            service = msgspec.structs.replace(service, env=env)
        given.append(service)
    return given, [user for user, _ in made.values()]


async def remove_users(config: Config, users: list[str]) -> None:
    """Delete the run's users (best effort: one left behind has a random password nobody knows)."""
    if not users:
        return
    admin: aioredis.Redis = redis_client(config.redis.url, socket_timeout=10)
    try:
        await admin.acl_deluser(*users)
    finally:
        await admin.aclose()


async def give_own_kafka_users(config: Config, services: list[Service]) -> tuple[list[Service], list[str]]:
    """``services`` logging in to Kafka each as a SCRAM user of its own with its service's ACLs, made through
    ``config.kafka`` (a super user), and the users made. Services that use no Kafka are left as they are."""
    run = f"run-{secrets.token_hex(3)}-"
    names = [s.name for s in services if s.name in kafka_users.USERS]
    passwords = {name: secrets.token_urlsafe(18) for name in names}
    logins = {name: run + name for name in names}
    await kafka_users.apply(config, passwords, logins)
    given = []
    for service in services:
        if service.name in logins:
            own = msgspec.structs.replace(
                config.kafka, sasl_username=logins[service.name], sasl_password=passwords[service.name]
            )
            env = {**service.env, **own.client_env()}
            service = msgspec.structs.replace(service, env=env)
        given.append(service)
    return given, list(logins.values())


async def remove_kafka_users(config: Config, users: list[str]) -> None:
    """Delete the run's Kafka users and their ACLs."""
    if users:
        await kafka_users.remove(config, users)

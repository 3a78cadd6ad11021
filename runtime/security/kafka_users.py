"""Kafka users, one per service: which topics each may read and write and which consumer group it may join.
Declared once here; ``turnstream kafka-users apply`` makes the users (SCRAM-SHA-512) and their ACLs from this table
on every deployment (compose's ``topics`` step, the chart's topics job, the test of it), so the rules deployed are
the rules tested.

What it buys, with the brokers' ``allow.everyone.if.no.acl.found=false``: a service's password writes only the topics
it produces. A judge cannot write ``samples`` (training past the dispatcher), a worker cannot publish ``weights`` or
a gate decision, no service can read the conversations of a topic it does not consume (the console reads them, as
it shows them), and only the operator (``admin``, a super user: ``topics create``, ``forget``, ``replay``,
``versions``, this command) can make or reconfigure topics. A consumer group is its service's alone, so no other
password can join it and take its partitions.

Every user may Describe every topic of its namespace (``turnstream topics wait`` checks that all exist before a
service starts). Every consumer writes ``deadletter`` (a record it cannot use goes there). No user needs a
transactional id or IdempotentWrite on the cluster: Kafka lets an idempotent producer start with Write on any topic.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Mapping

import msgspec
from aiokafka.admin import AIOKafkaAdminClient

from runtime.configuration.config import JUDGE_GROUP_PREFIX, Config
from runtime.messaging.acls import (
    Acl,
    Op,
    Pattern,
    Resource,
    create_acls,
    delete_acls,
    describe_acls,
    set_scram_users,
)
from runtime.messaging.bus import consumer_group
from schemas.modes import mode_spec
from schemas.topics import (
    ALL_TOPICS,
    DEADLETTER,
    EVALS,
    JUDGMENTS,
    SAMPLES,
    SESSIONS_ENDED,
    TEACHER,
    TURNS,
    TURNS_PAIRED,
    VERSIONS,
    WEIGHTS,
    TopicSpec,
    topic_name,
)


class Grant(msgspec.Struct, frozen=True):
    """What one service does with Kafka."""

    reads: tuple[TopicSpec, ...] = ()
    writes: tuple[TopicSpec, ...] = ()
    group: str | None = None
    """The config section whose ``group_id`` it consumes in (``judge``: every judge id's group)."""
    describes_groups: bool = False
    """It reads the pipeline groups' offsets (the console's lag)."""


USERS: dict[str, Grant] = {
    "proxy": Grant(reads=(WEIGHTS, VERSIONS), writes=(TURNS, SESSIONS_ENDED, DEADLETTER)),
    "pairer": Grant(reads=(TURNS, SESSIONS_ENDED), writes=(TURNS_PAIRED, DEADLETTER), group="pairer"),
    "judge": Grant(reads=(TURNS_PAIRED,), writes=(JUDGMENTS, DEADLETTER), group="judge"),
    "teacher": Grant(reads=(JUDGMENTS,), writes=(TEACHER, DEADLETTER), group="teacher"),
    "dispatcher": Grant(
        reads=(JUDGMENTS, TEACHER, SAMPLES), writes=(SAMPLES, DEADLETTER), group="dispatcher"
    ),
    "trainer": Grant(
        reads=(SAMPLES, WEIGHTS, VERSIONS), writes=(WEIGHTS, VERSIONS, DEADLETTER), group="trainer"
    ),
    "eval": Grant(reads=(EVALS,), writes=(EVALS,)),
    "gate": Grant(reads=(VERSIONS, EVALS, WEIGHTS), writes=(VERSIONS,)),
    "console": Grant(reads=tuple(t for t in ALL_TOPICS if t is not SESSIONS_ENDED), describes_groups=True),
}
"""Each service's topics and group (the proxy's reads are its weight loader's). ``simulate`` uses no Kafka."""

OPERATOR = "admin"
"""The brokers' super user, made when their storage is formatted (it makes every other user)."""
NAMES = (OPERATOR, *USERS)
"""Every user a password is made for (scripts/compose-secrets.sh, the chart): ``KAFKA_PASSWORD_<NAME>``."""


def principal(user: str) -> str:
    return f"User:{user}"


def _group(config: Config, section: str) -> tuple[str, Pattern]:
    """The group a service consumes in, in the namespace: each judge id has its own (``judge-alt``), so the judge's
    is a prefix."""
    if section == "judge":
        return consumer_group(config.kafka, JUDGE_GROUP_PREFIX), Pattern.PREFIXED
    return consumer_group(config.kafka, str(getattr(config, section).group_id)), Pattern.LITERAL


def _pipeline_groups(config: Config) -> list[tuple[str, Pattern]]:
    sections = ["pairer", "judge", "dispatcher"] + (
        ["teacher"] if mode_spec(config.dispatcher.mode).needs_hint else []
    )
    return [_group(config, s) for s in sections]


def acls(service: str, config: Config, login: str | None = None) -> list[Acl]:
    """``service``'s ACLs in ``config``'s namespace, for the user ``login`` (default: the service's name). Topics are
    named in full (LITERAL): the live namespace is empty, and a prefix ``turns`` would also match ``turns.paired``."""
    grant, who, ns = USERS[service], principal(login or service), config.kafka.namespace
    out = {Acl(who, Resource.TOPIC, topic_name(t.base, ns), Pattern.LITERAL, Op.DESCRIBE) for t in ALL_TOPICS}
    out |= {Acl(who, Resource.TOPIC, topic_name(t.base, ns), Pattern.LITERAL, Op.READ) for t in grant.reads}
    out |= {Acl(who, Resource.TOPIC, topic_name(t.base, ns), Pattern.LITERAL, Op.WRITE) for t in grant.writes}
    if grant.group:
        name, pattern = _group(config, grant.group)
        out.add(Acl(who, Resource.GROUP, name, pattern, Op.READ))
    if grant.describes_groups:
        out |= {Acl(who, Resource.GROUP, n, p, Op.DESCRIBE) for n, p in _pipeline_groups(config)}
    return sorted(out)


def all_acls(config: Config) -> list[Acl]:
    return sorted(a for user in USERS for a in acls(user, config))


def in_namespace(acl: Acl, config: Config) -> bool:
    """Whether ``acl`` is on a resource of ``config``'s namespace that this table governs: ``apply`` replaces
    those, and leaves a user's grants in another namespace alone."""
    if acl.resource is Resource.TOPIC:
        return acl.name in {topic_name(t.base, config.kafka.namespace) for t in ALL_TOPICS}
    if acl.resource is Resource.GROUP:
        own = consumer_group(config.kafka, "turnstream-")
        return acl.name.startswith(own) or acl.name in {n for n, _ in _pipeline_groups(config)}
    return False


async def apply(config: Config, passwords: Mapping[str, str], logins: Mapping[str, str] | None = None) -> int:
    """Make (or re-password) the SCRAM user of each service in ``passwords`` and give it exactly its ACLs in
    ``config``'s namespace (ones this table no longer grants there are removed), logged in as ``config.kafka``'s
    user, which must be a super user. ``logins``: service -> user name (default: the service's). Returns the number
    of ACLs added or removed."""
    from runtime.messaging.topics import _admin

    names = {s: (logins or {}).get(s, s) for s in passwords}
    admin = _admin(config.kafka)
    await admin.start()
    try:
        await set_scram_users(admin, {names[s]: p for s, p in passwords.items()})
        want = {a for s in passwords for a in acls(s, config, names[s])}
        have = {a for s in passwords for a in await describe_acls(admin, principal(names[s]))}
        stale = sorted(a for a in have - want if in_namespace(a, config))
        await create_acls(admin, sorted(want - have))
        await delete_acls(admin, stale)
        await _visible(admin, want, set(stale))
        return len(want - have) + len(stale)
    finally:
        await admin.close()


async def remove(config: Config, logins: Iterable[str]) -> None:
    """Delete these users and every ACL they hold (``turnstream run`` at its stop)."""
    from runtime.messaging.topics import _admin

    admin = _admin(config.kafka)
    await admin.start()
    try:
        users = list(logins)
        for user in users:
            await delete_acls(admin, await describe_acls(admin, principal(user)))
        await set_scram_users(admin, {}, users)
    finally:
        await admin.close()


async def _visible(
    admin: AIOKafkaAdminClient, want: set[Acl], gone: set[Acl], timeout_s: float = 30.0
) -> None:
    """Wait until the broker answering describes the change: the controller commits ACLs to the metadata log, and
    a broker authorizes by its own copy, which follows a moment later."""
    deadline = time.monotonic() + timeout_s
    while True:
        have = set(await describe_acls(admin, None))
        if want <= have and not gone & have:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(want - have)} ACLs not visible after {timeout_s:.0f} s")
        await asyncio.sleep(0.2)


def required(passwords: Mapping[str, str], names: tuple[str, ...] = NAMES) -> None:
    if missing := [n for n in names if not passwords.get(n)]:
        raise ValueError(f"no Kafka password for: {', '.join(missing)}")

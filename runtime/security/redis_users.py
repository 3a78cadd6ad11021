"""Redis ACL users, one per service: which keys and commands each may use. Declared once here; every deployment
renders them from this table (compose's ``redis-users`` step, the chart's Redis init container, ``turnstream run``,
and the test of it), so the rules deployed are the rules tested.

What it buys: a service's password opens only its own keys. The pairer's cannot read a conversation the proxy
stored, a worker's cannot hold the reload lease or write the dispatcher's joins, and no service may flush, reconfigure
or re-point Redis (``-@all`` first, then each command named). Every user may read and make the sealing keys
(``kafka.seal_keys_prefix``): each service seals or opens the records of the topics that hold conversations, and
seals its dead letters. Destroying one is ``turnstream forget``'s, which runs as ``admin``.

``{prefix}`` is ``redis.key_prefix``, ``{dek}`` ``kafka.seal_keys_prefix``; both are filled in when rendered.
The default user is off (``DEFAULT_RULES`` says why its permissions stay whole) and ``probe`` may only PING (health
checks, without a password); ``admin`` may do anything (operators:
``redis-cli``, ``forget``, ``replay``); ``replica`` is a replica's link to its master, ``sentinel`` a Sentinel's
to the servers, ``client`` the services' login on the Sentinels (it may only ask where the master is).
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Mapping
from urllib.parse import quote, urlsplit, urlunsplit

import redis.asyncio as aioredis

CONNECTION = "+ping +select +client|reply"
"""Every service user's: PING, SELECT of its database and the pipelined client's ``CLIENT REPLY`` (AUTH and HELLO
need no permission)."""

SEAL = "~{dek}* +get +set +exists +eval +wait +info"
"""Make (``SET NX`` in a script), read and wait for the replicas of the sealing keys (``runtime/security/erasure``)."""

USERS: dict[str, str] = {
    "proxy": (
        "~{prefix}turns:* ~{prefix}turn-nonce:* ~{prefix}conv:* ~{prefix}resp:* ~{prefix}resp-owner:* "
        "~{prefix}reload:lease:* %R~{prefix}eval:hold:* +del +incr +incrby +decr +decrby +expire +pexpire +pttl "
        "+evalsha +zadd +zrem +zcard +zrange +zrangebyscore"
    ),
    "pairer": (
        "~{prefix}pairer:* +mget +del +zadd +zrem +zrangebyscore +multi +exec +discard +evalsha +script|load"
    ),
    "dispatcher": (
        "~{prefix}disp:* +del +hgetall +hset +hsetnx +hkeys +pexpire +zadd +zrem +zcard +zrangebyscore "
        "+multi +exec +discard +evalsha +script|load"
    ),
    "judge": "",
    "teacher": "",
    "trainer": "",
    "gate": "",
    "topics": "",
    "simulate": "",
    "eval": "~{prefix}eval:hold:* +del",
    "console": "",  # reads the sealing keys only: see READ_ONLY
}
"""Each service's rules beyond ``CONNECTION`` and ``SEAL``: its own keys and the commands it runs on them (also those
its Lua scripts run: Redis checks a script's calls against the caller's rules)."""

READ_ONLY = {"console"}
"""Services that only open sealed records: ``%R~{dek}* +get +exists`` instead of ``SEAL``."""

OPERATOR = "admin"
DEFAULT_RULES = "off nopass ~* &* +@all"
"""Nobody logs in as the default user, but its permissions stay whole: Redis replays the transactions of its
append-only file (a script's writes among them) with the default user's permissions at start, so a restricted
default user makes every one of them fail there, and their writes are lost without an error to any client
(Redis 7.0.15 and 7.4; valkey-io/valkey#3983). ``PROBE`` answers health checks instead."""
PROBE = "probe"
PROBE_RULES = "on nopass resetkeys resetchannels -@all +ping"
"""Health checks log in as ``probe`` with any password (``redis-cli --user probe --pass probe ping``): PING only."""
OPERATOR_RULES = "~* &* +@all"
REPLICA_RULES = "resetkeys resetchannels -@all +psync +replconf +ping"
SENTINEL_RULES = (
    "resetkeys resetchannels -@all allchannels +multi +slaveof +ping +exec +subscribe +config|rewrite +role "
    "+publish +info +client|setname +client|kill +script|kill"
)
"""On the servers, what a Sentinel runs to watch and fail over the master (Redis's documented list)."""
CLIENT_RULES = (
    "-@all +hello +ping +role +command +client|setname +client|getname +client|id +sentinel|masters "
    "+sentinel|master +sentinel|get-master-addr-by-name +sentinel|replicas +sentinel|sentinels +sentinel|myid"
)
"""On the Sentinels, what a service may ask: where the master is, nothing that re-points it."""
INFRA = (OPERATOR, "replica", "sentinel", "client")
"""The users that are no service's: each needs a password too."""
NAMES = (*INFRA, *USERS)
"""Every user a password is made for (scripts/compose-secrets.sh, the chart): ``REDIS_PASSWORD_<NAME>``."""


def rules(service: str, prefix: str = "turnstream:", dek: str = "turnstream:dek:") -> str:
    """``service``'s ACL rules (no ``on``, no password), its key patterns filled in."""
    seal = "%R~{dek}* +get +exists" if service in READ_ONLY else SEAL
    text = f"resetkeys resetchannels -@all {CONNECTION} {seal} {USERS[service]}".strip()
    return text.format(prefix=_glob_literal(prefix), dek=_glob_literal(dek))


def _glob_literal(prefix: str) -> str:
    """A prefix as it stands in a key pattern: the glob's own characters escaped, so a prefix means only itself."""
    if any(c.isspace() for c in prefix):
        raise ValueError(f"a Redis key prefix with white space cannot be an ACL pattern: {prefix!r}")
    return "".join("\\" + c if c in "*?[]\\" else c for c in prefix)


def password_hash(password: str) -> str:
    """How the ACL file keeps a password: ``#`` and its SHA-256 (Redis compares hashes; the file reveals none)."""
    return "#" + hashlib.sha256(password.encode()).hexdigest()


def _required(passwords: Mapping[str, str]) -> None:
    if missing := [n for n in NAMES if not passwords.get(n)]:
        raise ValueError(f"no Redis password for: {', '.join(missing)}")


def acl_file(passwords: Mapping[str, str], prefix: str = "turnstream:", dek: str = "turnstream:dek:") -> str:
    """A Redis server's ACL file (``aclfile``): the default user off, ``probe`` (PING only, no password),
    ``admin``, ``replica``, ``sentinel`` and each service in ``USERS``, each with the password named for it in
    ``passwords`` (all of ``NAMES``)."""
    _required(passwords)
    lines = [f"user default {DEFAULT_RULES}", f"user {PROBE} {PROBE_RULES}"]
    lines.append(f"user {OPERATOR} on {password_hash(passwords[OPERATOR])} {OPERATOR_RULES}")
    lines.append(f"user replica on {password_hash(passwords['replica'])} {REPLICA_RULES}")
    lines.append(f"user sentinel on {password_hash(passwords['sentinel'])} {SENTINEL_RULES}")
    lines += [f"user {s} on {password_hash(passwords[s])} {rules(s, prefix, dek)}" for s in USERS]
    return "\n".join(lines) + "\n"


def sentinel_users(passwords: Mapping[str, str]) -> str:
    """The user lines of a Sentinel's configuration: the default user off (health checks log in as ``client``),
    ``admin`` (the Sentinels among themselves, operators) and ``client`` (every service, to find the master)."""
    _required(passwords)
    return (
        "user default off\n"
        f"user {OPERATOR} on {password_hash(passwords[OPERATOR])} allchannels +@all\n"
        f"user client on {password_hash(passwords['client'])} {CLIENT_RULES}\n"
    )


def with_user(url: str, user: str, password: str) -> str:
    """``url`` (``redis://``, ``rediss://`` or ``redis+sentinel://``) logging in as ``user``: the credentials of the
    server, not of the Sentinels (those stay in its query)."""
    parts = urlsplit(url)
    host = parts.netloc.rpartition("@")[2]
    netloc = f"{quote(user, safe='')}:{quote(password, safe='')}@{host}"
    return urlunsplit(parts._replace(netloc=netloc))


async def provision(
    admin: aioredis.Redis, services: list[str], prefix: str, dek: str, name_prefix: str = ""
) -> dict[str, tuple[str, str]]:
    """Create (or replace) an ACL user for each of ``services`` with a new random password, through a connection
    that may (``admin``): ``turnstream run`` gives each service it starts its own. Returns service -> (user,
    password); the users are named ``name_prefix + service``."""
    made: dict[str, tuple[str, str]] = {}
    for service in services:
        user, password = name_prefix + service, secrets.token_urlsafe(24)
        await admin.execute_command(  # type: ignore[no-untyped-call]
            "ACL", "SETUSER", user, "reset", "on", f">{password}", *rules(service, prefix, dek).split()
        )
        made[service] = (user, password)
    return made

"""Where a Redis URL leads: one server (``redis://``, ``rediss://``, ``unix://``), or the current master of a group
that Redis Sentinel watches and fails over (``redis+sentinel://``). Every turnstream client of Redis connects
through here (redis-py's clients by ``redis_client``, the proxy's pipelined one by ``PipelinedRedis``), so one
setting, ``redis.url`` (and ``kafka.seal_keys_url``), makes every service follow a failover.

``redis+sentinel://[[user]:password@]host:port[,host:port...]/<master name>[/<db>][?sentinel_username=...&
sentinel_password=...]``: the Sentinels to ask (26379 when a port is left out), the name they know the group by, the
database; the user and password are the master's (an ACL user of its own per service), ``sentinel_username`` and
``sentinel_password`` the Sentinels' own when they require them (ACL users on the Sentinels: the default user off).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, unquote

import redis.asyncio as aioredis

SCHEME = "redis+sentinel://"


@dataclass(frozen=True)
class SentinelTarget:
    sentinels: list[tuple[str, int]]
    master: str
    db: int = 0
    username: str | None = None
    password: str | None = None
    sentinel_password: str | None = None
    sentinel_username: str | None = None

    def sentinel(self, timeout_s: float = 5.0) -> Any:
        """redis-py's ``Sentinel`` for these Sentinels (it finds the master and follows a failover)."""
        from redis.asyncio.sentinel import Sentinel

        sentinel_kwargs: dict[str, Any] = {"socket_timeout": timeout_s, "socket_connect_timeout": timeout_s}
        if self.sentinel_password:
            sentinel_kwargs["password"] = self.sentinel_password
        if self.sentinel_username:
            sentinel_kwargs["username"] = self.sentinel_username
        return Sentinel(  # type: ignore[no-untyped-call]
            self.sentinels, sentinel_kwargs=sentinel_kwargs, socket_connect_timeout=timeout_s
        )


def sentinel_target(url: str) -> SentinelTarget | None:
    """The Sentinel group a ``redis+sentinel://`` URL names; None for any other URL. Raises ValueError when it is
    malformed."""
    if not url.startswith(SCHEME):
        return None
    rest, _, query = url[len(SCHEME) :].partition("?")
    where, _, path = rest.partition("/")
    credentials, _, hosts = where.rpartition("@")
    username = password = None
    if credentials:
        user, _, secret = credentials.partition(":")
        username, password = unquote(user) or None, unquote(secret) or None
    sentinels: list[tuple[str, int]] = []
    for host in filter(None, (h.strip() for h in hosts.split(","))):
        name, _, port = host.rpartition(":") if ":" in host else (host, "", "26379")
        if not name or not port.isdigit():
            raise ValueError(f"redis+sentinel URL: {host!r} is not host:port")
        sentinels.append((name, int(port)))
    parts = [p for p in path.split("/") if p]
    if not sentinels or not parts or len(parts) > 2 or (len(parts) == 2 and not parts[1].isdigit()):
        raise ValueError(
            "a Sentinel URL is redis+sentinel://[user:password@]host:port[,host:port...]/<master name>[/<db>]"
        )
    options = parse_qs(query)
    return SentinelTarget(
        sentinels,
        unquote(parts[0]),
        int(parts[1]) if len(parts) == 2 else 0,
        username,
        password,
        options.get("sentinel_password", [None])[0],
        options.get("sentinel_username", [None])[0],
    )


def redis_client(url: str, **kwargs: Any) -> aioredis.Redis:
    """redis-py's asyncio client for ``url``: a Sentinel group's master (found again after a failover: a command
    to a demoted master fails once and the next one goes to the new master), else ``from_url``."""
    # No CLIENT SETINFO on connect: a service's ACL user may not run it, and each refusal would land in ACL LOG,
    # where a real denial must stand out.
    kwargs = {"lib_name": None, "lib_version": None, **kwargs}
    target = sentinel_target(url)
    if target is None:
        return aioredis.from_url(url, **kwargs)
    client: aioredis.Redis = target.sentinel().master_for(
        target.master, db=target.db, username=target.username, password=target.password, **kwargs
    )
    return client

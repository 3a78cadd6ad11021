"""Conversation continuity: which session a main turn without a session id continues.

Stock clients (OpenClaw from npm, the OpenAI SDKs, chat UIs) send no session id, but each request repeats the
conversation so far: the previous request's messages, the answer the proxy returned, then what the user (or a tool)
said next. So after each answer the proxy stores, in Redis, a hash of that conversation *including the answer*
naming the session and turn; a later request whose messages up to its last assistant message hash the same continues
that session. Across proxy replicas, because the state is in Redis.

The hash is of a canonical form that ignores what clients legitimately change when they send history back:
whitespace at the ends of content, content as a string or as a list of text parts, reasoning content (and a leading
think block), tool-call ids, the spacing and key order of tool-call arguments, and a system prompt's volatile
sections; what a client adds to one request only (messages, a context pair, a reminder appended to the current
message) is left out (``runtime/pipeline/envelopes.py``). It is
seeded with the caller's scope (the bearer token or API key, and the ``user`` field), so two people who type the
same first message never share a session.

Each stored link can be continued once. A request that continues a link already continued is a branch (the client
edited or regenerated a message): it starts a new session, and when the turn it supersedes is still its session's
newest, that turn is closed as ``regenerated``.

Cost on the request path: one streaming SHA-256 pass (hardware-accelerated on x86 and ARM; BLAKE2b took 2.6 times
as long on OpenClaw's 48k-character system prompt) over the canonical messages, no per-prefix hashing; one Redis
script call that replaces the turn-number ``INCR`` and overlaps the engine's work; one ``SET`` after the answer.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgspec
from prometheus_client import Counter

from runtime.pipeline.envelopes import (
    opens_pair,
    request_only,
    stable_system,
    visible_answer,
    without_reminder,
)
from runtime.transport.resp import PipelinedRedis, RedisReplyError, command
from services.proxy import inner_json

log = logging.getLogger("turnstream.proxy")

_pack = msgspec.msgpack.Encoder().encode
_sorted_json = msgspec.json.Encoder(order="sorted").encode

# KEYS[1]: the link the request continues (absent when it continues none: no empty key name, which a Redis ACL
# refuses); ARGV[1]: the turn counters' prefix,
# ARGV[2]: a new session id, ARGV[3]: a counter's expiry after its session's last turn. Returns a status line (the
# pipelined client reads those):
#   "new SID N" | "continue SID N" | "branch SID N OLD_SID SUPERSEDED" (SUPERSEDED 0: none to close).
_RESOLVE = b"""
local counters, fresh = ARGV[1], ARGV[2]
local function bump(sid)
  local n = redis.call('INCR', counters .. sid)
  redis.call('EXPIRE', counters .. sid, ARGV[3])
  return n
end
local link = false
if KEYS[1] then link = redis.call('GET', KEYS[1]) end
if link then
  local sid, n, taken = string.match(link, '^(%S+) (%d+)(.*)$')
  if taken == '' then
    redis.call('SET', KEYS[1], link .. ' c', 'KEEPTTL')
    return {ok = 'continue ' .. sid .. ' ' .. bump(sid)}
  end
  local newest = tonumber(redis.call('GET', counters .. sid) or '0')
  local superseded = 0
  if newest == tonumber(n) + 1 then superseded = newest end
  return {ok = 'branch ' .. fresh .. ' ' .. bump(fresh) .. ' ' .. sid .. ' ' .. superseded}
end
return {ok = 'new ' .. fresh .. ' ' .. bump(fresh)}
"""
_RESOLVE_SHA = hashlib.sha1(_RESOLVE).hexdigest().encode()

# A turn that resolved but was never answered (the engine failed, the stream broke off): its link is free again
# and its number given back when nothing took a later one, so the client's retry continues the session.
# KEYS[1]: the link (absent when none), ARGV[1]: the session's counter, ARGV[2]: the turn's number.
_RELEASE = b"""
if KEYS[1] then
  local link = redis.call('GET', KEYS[1])
  if link and string.sub(link, -2) == ' c' then
    redis.call('SET', KEYS[1], string.sub(link, 1, -3), 'KEEPTTL')
  end
end
if tonumber(redis.call('GET', ARGV[1]) or '0') == tonumber(ARGV[2]) then redis.call('DECR', ARGV[1]) end
return 1
"""


def _arguments(raw: object) -> bytes:
    """Tool-call arguments as data: re-serialised JSON (other spacing, key order) is the same call."""
    if isinstance(raw, str):
        try:
            return _sorted_json(inner_json.loads(raw))
        except ValueError:
            return raw.encode()
    return _sorted_json(raw)


def _tool_calls(message: Mapping[str, Any]) -> list[tuple[Any, bytes]]:
    """Tool calls as (name, arguments as sorted JSON): ids and argument formatting do not count."""
    return [
        ((c.get("function") or {}).get("name"), _arguments((c.get("function") or {}).get("arguments", "")))
        for c in message.get("tool_calls") or ()
        if isinstance(c, Mapping)
    ]


def canonical(message: Mapping[str, Any]) -> bytes:
    """One message as the bytes the conversation hash reads (see the module docstring for what is ignored)."""
    return _canonical(message, message.get("role"), message.get("content"))


def _canonical(message: Mapping[str, Any], role: object, content: object) -> bytes:
    extra: list[Any] | None = None
    if isinstance(content, str):
        text = content
    elif isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, Mapping) and part.get("type", "text") == "text":
                texts.append(str(part.get("text", "")))
            else:  # an image or audio part: compared as it is
                (extra := extra or []).append(part)
        text = "".join(texts)
    else:
        text = ""
    if role == "system":
        text = stable_system(text)
    elif role == "user":
        text = without_reminder(text)
    elif role == "assistant" and text.startswith("<think>"):
        text = visible_answer(text)
    if message.get("tool_calls") and (calls := _tool_calls(message)):
        (extra := extra or []).append(calls)
    return _pack((role, text.strip(), _sorted_json(extra) if extra else b""))


@dataclass(frozen=True)
class Links:
    """A request's place in its conversation: the link it continues and the hash state to store its own."""

    continues: bytes | None
    """The hash of the messages up to the last assistant message, when new messages follow it."""
    state: Any
    """The running hash over all of the request's messages (``hashlib`` object), extended by the answer."""


@dataclass(frozen=True)
class Asked:
    """A resolution sent to Redis, its reply not read yet."""

    reply: asyncio.Future[Any]
    args: tuple[bytes, ...]


@dataclass(frozen=True)
class Resolved:
    session_id: str
    turn_index: int
    how: str
    """``new``, ``continue`` or ``branch``."""
    superseded: tuple[str, int] | None = None
    """(session id, turn index) of the turn a branch supersedes, when it is still its session's newest."""


def scope(headers: Mapping[str, str], body: Mapping[str, Any]) -> bytes:
    """Who is talking: the credentials the request carries and its ``user`` field."""
    user = body.get("user")
    return _pack(
        (
            headers.get("authorization", ""),
            headers.get("x-api-key", ""),
            user if isinstance(user, str) else "",
        )
    )


def links(headers: Mapping[str, str], body: Mapping[str, Any]) -> Links:
    messages = body["messages"]
    h = hashlib.sha256(scope(headers, body))
    continues: bytes | None = None
    after = False  # a user or tool message after the last assistant message
    update = h.update
    reply = False  # the next message is a context pair's canned reply (``envelopes.opens_pair``)
    for m in messages:  # per message of every request: kept to the bare minimum of Python
        role, content = m.get("role"), m.get("content")
        if reply:
            reply = False
            if role == "assistant":
                continue
        if (role == "user" or role == "system") and request_only(m):
            reply = role == "user" and opens_pair(m)
            continue
        update(_canonical(m, role, content))
        if role == "assistant":
            continues, after = h.digest()[:16], False
        else:
            after = True
    return Links(continues if after else None, h)


def answered(state: Any, response: Mapping[str, Any]) -> bytes:
    """The hash of a request's conversation followed by the answer it got: the link the next request continues."""
    h = state.copy()
    h.update(canonical(response))
    digest: bytes = h.digest()[:16]
    return digest


class Continuity:
    """The Redis side: resolve a request's session, store the link its answer makes."""

    def __init__(
        self, redis: PipelinedRedis, key_prefix: str, ttl_s: int, *, session_ttl_s: int = 30 * 86400
    ) -> None:
        self.redis = redis
        self.link_prefix = f"{key_prefix}conv:".encode()
        self.counters = f"{key_prefix}turns:".encode()
        self.ttl = str(ttl_s).encode()
        self.session_ttl = str(session_ttl_s).encode()

    def _key(self, digest: bytes) -> bytes:
        return self.link_prefix + digest.hex().encode()

    def ask(self, continues: bytes | None, fresh: str) -> Asked:
        """Send the resolution now (written to the connection before the engine call is even prepared, so that
        its reply is usually read in the same wake-up as the engine's); ``resolve`` reads it."""
        keys = (b"1", self._key(continues)) if continues is not None else (b"0",)
        args = (*keys, self.counters, fresh.encode(), self.session_ttl)
        return Asked(asyncio.ensure_future(self.redis.send(command(b"EVALSHA", _RESOLVE_SHA, *args))), args)

    async def resolve(self, asked: Asked) -> Resolved:
        try:
            reply = await asked.reply
        except RedisReplyError as exc:
            if "NOSCRIPT" not in str(exc):
                raise
            reply = await self.redis.send(command(b"EVAL", _RESOLVE, *asked.args))
        how, sid, n, *rest = str(reply).split(" ")
        superseded = (rest[0], int(rest[1])) if how == "branch" and rest[1] != "0" else None
        return Resolved(sid, int(n), how, superseded)

    def release(self, continues: bytes | None, resolved: Resolved) -> Any:
        """Undo a resolution whose turn was never answered (see ``_RELEASE``)."""
        keys = (
            (b"1", self._key(continues)) if continues is not None and resolved.how == "continue" else (b"0",)
        )
        counter = self.counters + resolved.session_id.encode()
        return self.redis.send(command(b"EVAL", _RELEASE, *keys, counter, str(resolved.turn_index).encode()))

    def link(self, digest: bytes, session_id: str, turn_index: int) -> Any:
        """Store the link an answer makes; written to the connection at once (before the answer's last bytes go
        out, so the client's next request finds it), its reply skipped (``PipelinedRedis.fire``: None) or awaited
        by nobody on the request path."""
        value = b"%s %d" % (session_id.encode(), turn_index)
        return self.redis.fire(command(b"SET", self._key(digest), value, b"EX", self.ttl))


SESSIONS = Counter(
    "turnstream_proxy_sessions_total",
    "Main turns by how their session was found: explicit (an id sent), continue (inferred), new, branch, "
    "unresolved (Redis did not answer)",
    ["how"],
)
WARN_AFTER = 20
"""Main turns after which a proxy that found no session for any of them says so, once."""


class SessionWatch:
    """Counts how main turns found their session, and warns once when none ever does: then nothing is paired,
    judged or trained on, and the user should know why."""

    def __init__(self) -> None:
        self.seen = 0
        self.found = 0
        self.warned = False
        self._children = {
            how: SESSIONS.labels(how) for how in ("explicit", "continue", "new", "branch", "unresolved")
        }

    def count(self, how: str) -> None:
        self._children[how].inc()
        self.seen += 1
        if how in ("explicit", "continue"):
            self.found += 1
        elif not self.warned and not self.found and self.seen >= WARN_AFTER:
            self.warned = True
            log.warning(
                f"the last {self.seen} main turns arrived without session ids and did not continue earlier turns:"
                " each is a session of one turn, never paired, judged or trained on. Send X-Session-Id, or send"
                " each request with the conversation so far (see docs/clients.md)"
            )

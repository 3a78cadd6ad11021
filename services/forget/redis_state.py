"""The Redis keys that name a session, in any key prefix (the live one, and each replay namespace's).

Deleting is by the forms below; the proof (``leftovers``) looks for the same forms, and the end-to-end test
(``tests/services/forget``) checks that no key holding the session id survives at all, so a service that adds a
new kind of key without adding it here fails there.
"""

from __future__ import annotations

from collections.abc import Iterable

from redis import asyncio as aioredis

SESSION_KEYS = ("turns:", "owner:", "pairer:s:", "pairer:ended:", "disp:s:")
"""Keys ``<prefix><form><session id>``: the proxy's turn counter and owner (``owner:``, written by proxies before
sessions lived in their user's namespace), the pairer's open turn and ended
mark, the dispatcher's session mark. (The data key, ``kafka.seal_keys_prefix``, is destroyed first, apart.)"""
TURN_KEYS = ("disp:t:", "disp:done:")
"""Keys ``<prefix><form><session id>:<n>``: the dispatcher's joins and decisions, per turn."""
SESSION_SETS = ("pairer:idle",)
"""Sorted sets whose members are session ids."""
TURN_SETS = ("disp:open",)
"""Sorted sets whose members are turn ids."""
LINKS = "conv:"
"""Conversation links (session inference): the key is a hash, the value ``<session id> <n>[ c]``."""
STORED = "resp:"
"""Stored responses (``previous_response_id``): the key is a random id, the value ``<session id> <payload>``."""


def _glob(text: str) -> str:
    """``text`` matched literally in a Redis MATCH pattern."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


def _of_sessions(turn_id: str, sessions: set[str]) -> bool:
    session, _, index = turn_id.rpartition(":")
    return index.isdigit() and session in sessions


def names_session(key: str, sessions: set[str]) -> bool:
    """Whether ``key`` is one of the forms above for one of ``sessions``."""
    for form in SESSION_KEYS:
        at = key.rfind(form)
        if at >= 0 and key[at + len(form) :] in sessions:
            return True
    for form in TURN_KEYS:
        at = key.find(form)
        if at >= 0 and _of_sessions(key[at + len(form) :], sessions):
            return True
    return False


async def _session_keys(r: aioredis.Redis, sessions: set[str]) -> list[bytes]:
    found: list[bytes] = []
    for sid in sessions:
        async for name in r.scan_iter(match=f"*{_glob(sid)}*", count=1000):
            if names_session(name.decode("utf-8", "replace"), sessions):
                found.append(name)
    return found


async def _set_members(r: aioredis.Redis, sessions: set[str]) -> list[tuple[bytes, list[bytes]]]:
    """(sorted set, its members of the sessions)."""
    out: list[tuple[bytes, list[bytes]]] = []
    for form in SESSION_SETS + TURN_SETS:
        per_turn = form in TURN_SETS
        async for name in r.scan_iter(match=f"*{form}", count=1000):
            members = []
            async for member, _ in r.zscan_iter(name):
                text = member.decode("utf-8", "replace")
                if _of_sessions(text, sessions) if per_turn else text in sessions:
                    members.append(member)
            if members:
                out.append((name, members))
    return out


async def _links(r: aioredis.Redis, sessions: set[str]) -> list[bytes]:
    """Conversation links and stored responses of the sessions (both name their session first in the value)."""
    found: list[bytes] = []
    for form in (LINKS, STORED):
        async for name in r.scan_iter(match=f"*{form}*", count=1000):
            value = await r.get(name)
            if isinstance(value, bytes) and value.split(b" ", 1)[0].decode("utf-8", "replace") in sessions:
                found.append(name)
    return found


async def forget_state(r: aioredis.Redis, sessions: Iterable[str]) -> int:
    """Delete the sessions' keys, set members and conversation links; how many were removed."""
    wanted = set(sessions)
    removed = 0
    doomed = await _session_keys(r, wanted) + await _links(r, wanted)
    if doomed:
        removed += int(await r.delete(*doomed))
    for name, members in await _set_members(r, wanted):
        removed += int(await r.zrem(name, *members))
    return removed


async def leftovers(r: aioredis.Redis, sessions: Iterable[str]) -> list[str]:
    """What still names the sessions: keys, ``set member`` entries and links."""
    wanted = set(sessions)
    left = [k.decode("utf-8", "replace") for k in await _session_keys(r, wanted) + await _links(r, wanted)]
    for name, members in await _set_members(r, wanted):
        left += [f"{name.decode('utf-8', 'replace')} {m.decode('utf-8', 'replace')}" for m in members]
    return left

"""The session fields a request carries: OpenClaw-RL's (``X-Session-Id``, ``X-Turn-Type``, ``X-Session-Done``, or
the same names in the body) and the session ids stock clients send."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from starlette.datastructures import Headers

from schemas import OWNER_SEPARATOR, session_id_problem

BODY_FIELDS = ("session_id", "turn_type", "session_done")
TRUE = {"1", "true", "yes", "on"}


class SessionError(ValueError):
    pass


@dataclass(frozen=True)
class SessionInfo:
    session_id: str | None
    turn_type: str
    """``main`` (recorded) or ``side`` (forwarded, never recorded)."""
    done: bool


def _flag(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    return str(value).strip().lower() in TRUE


def session_info(
    headers: Headers, body: dict[str, Any], default_turn_type: str = "main", hint: str | None = None
) -> SessionInfo:
    """Read the session fields and strip the body's copies (the engine must not see them). Headers win; then the
    body; then the ids stock clients send; then ``hint`` (what an API's own clients send, ``Api.session_hint``).
    An untagged request is ``default_turn_type`` (``proxy.default_turn_type``)."""
    b_sid, b_type, b_done = (body.pop(k, None) for k in BODY_FIELDS)
    if not isinstance(b_sid, str | None) or not isinstance(b_type, str | None):
        raise SessionError("'session_id' and 'turn_type' in the body must be strings")
    if not isinstance(b_done, bool | int | str | None):
        raise SessionError("'session_done' in the body must be a boolean")
    # Explicit ids, most specific first: ours, the body's, then the ids stock clients already send (OpenClaw with
    # ``compat.sendSessionAffinityHeaders``: ``x-session-affinity`` and ``session_id``).
    sid = (
        headers.get("x-session-id")
        or b_sid
        or headers.get("x-session-affinity")
        or headers.get("session_id")
        or hint
    )
    turn_type = (headers.get("x-turn-type") or b_type or default_turn_type).strip().lower()
    if turn_type not in ("main", "side"):
        raise SessionError(f"X-Turn-Type must be 'main' or 'side', not {turn_type!r}")
    done_raw = headers.get("x-session-done")
    done = _flag(done_raw) if done_raw is not None else (_flag(b_done) if b_done is not None else False)
    if sid is not None:
        sid = sid.strip()
        if (problem := session_id_problem(sid)) is not None:
            raise SessionError(problem)
    return SessionInfo(sid or None, turn_type, done)


def new_session_id() -> str:
    return f"anon-{uuid.uuid4().hex}"


def recorded_id(owner: str, session_id: str) -> str:
    """The id a session is recorded under. With per-user keys every id, named by the client or by the proxy, lives
    in its user's namespace (``alice/s1``): another key that sends ``s1``, or even ``alice/s1``, names a session of
    its own, so nobody can write to, end or squat another user's session, nor learn whether it exists. One user
    (a single key, or none): the id as sent."""
    return f"{owner}{OWNER_SEPARATOR}{session_id}" if owner else session_id


def shown_id(owner: str, recorded: str) -> str:
    """The id the client knows a recorded session by (``X-Session-Id`` in responses): its namespace taken off."""
    prefix = f"{owner}{OWNER_SEPARATOR}" if owner else ""
    return recorded[len(prefix) :] if prefix and recorded.startswith(prefix) else recorded

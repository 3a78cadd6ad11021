"""What a session id and a user id may be: one rule for the proxy that accepts them and for everything that takes
them from elsewhere (a replay import), since an id travels into Kafka keys, Redis keys, response headers and
console URLs."""

from __future__ import annotations

SESSION_ID_MAX = 256
"""The longest session id a client may send."""
USER_ID_MAX = 64
"""The longest user id a proxy keys file may name."""
OWNER_SEPARATOR = "/"
"""Between the owner and the client's id in a session id recorded under per-user keys (``alice/s1``); never in a
user id."""
RECORDED_SESSION_ID_MAX = USER_ID_MAX + len(OWNER_SEPARATOR) + SESSION_ID_MAX
"""The longest session id on the topics: a client's id in its user's namespace."""


def session_id_problem(session_id: object, longest: int = SESSION_ID_MAX) -> str | None:
    """Why ``session_id`` is not a session id (None when it is): 1 to ``longest`` printable ASCII characters (a
    response header carries it, where anything beyond ASCII is mis-decoded by clients)."""
    if not isinstance(session_id, str):
        return "a session id must be a string"
    if not session_id or len(session_id) > longest or not (session_id.isascii() and session_id.isprintable()):
        return f"a session id must be 1-{longest} printable ASCII characters"
    return None


def user_id_problem(user: str) -> str | None:
    """Why ``user`` is not a user id (None when it is): 1 to 64 printable ASCII characters without spaces or
    ``/``, so that ``<user>/<session>`` names one session of one user."""
    if not user or len(user) > USER_ID_MAX or not (user.isascii() and user.isprintable()):
        return f"a user id must be 1-{USER_ID_MAX} printable ASCII characters"
    if OWNER_SEPARATOR in user or " " in user:
        return f"a user id may not contain spaces or {OWNER_SEPARATOR!r}"
    return None

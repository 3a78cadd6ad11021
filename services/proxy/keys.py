"""Who may use the proxy: its keys, each naming a user.

``proxy.api_key`` is one key (user ``default``); ``proxy.keys_file`` holds one key per user, a line
``<user id> <key>`` each (``#`` starts a comment), so people can be told apart and one key revoked alone. Keys are
looked up by their SHA-256, so comparing a presented key costs the same whatever it shares with a real one.
"""

from __future__ import annotations

import hashlib
import logging
import stat
from pathlib import Path

from runtime.security.addresses import is_loopback
from schemas import user_id_problem

log = logging.getLogger("turnstream.proxy")

DEFAULT_USER = "default"


class KeyFileError(ValueError):
    """A keys file that cannot be used; the message names the file and line."""


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


def read_keys_file(path: Path) -> dict[bytes, str]:
    """Key digest -> user id. Refuses duplicate keys and lines without both fields; warns when others can read it."""
    try:
        text = path.read_text()
        mode = path.stat().st_mode
    except OSError as exc:
        raise KeyFileError(f"proxy.keys_file {path}: {exc.strerror}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning(f"proxy.keys_file {path} is readable by others: chmod 600 it", extra={"mode": oct(mode)})
    keys: dict[bytes, str] = {}
    for n, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2 or len(parts[1]) < 16:
            raise KeyFileError(f"{path}:{n}: expected '<user id> <key>' with a key of at least 16 characters")
        user, key = parts
        if (problem := user_id_problem(user)) is not None:
            raise KeyFileError(f"{path}:{n}: {problem} (sessions are recorded as '<user id>/<session id>')")
        digest = _digest(key.encode())
        if digest in keys:
            raise KeyFileError(f"{path}:{n}: this key is already given to {keys[digest]!r}")
        keys[digest] = user
    return keys


class ProxyKeys:
    def __init__(self, api_key: str | None, keys_file: str) -> None:
        self.users: dict[bytes, str] = read_keys_file(Path(keys_file)) if keys_file else {}
        self.per_user = bool(self.users)
        """Users told apart: each session belongs to the user whose key started it, and a turn's ``user`` is the
        key's user, not what the client wrote."""
        if api_key:
            self.users[_digest(api_key.encode())] = DEFAULT_USER

    @property
    def required(self) -> bool:
        return bool(self.users)

    def user(self, authorization: str | None) -> str | None:
        """The user a request's ``Authorization: Bearer <key>`` names; None for no key, a wrong one, or another
        scheme. Without keys configured every request is ``default``'s."""
        if not self.users:
            return DEFAULT_USER
        if not authorization:
            return None
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer":
            return None
        return self.users.get(_digest(token.strip().encode()))


def refuse_without_keys(host: str, keys: ProxyKeys) -> str | None:
    """Why the proxy must not start (listening beyond loopback with no key), or None."""
    if keys.required or is_loopback(host):
        return None
    return (
        f"the proxy would serve anyone who reaches {host} and record their conversations: set proxy.api_key "
        "(TURNSTREAM_PROXY_API_KEY) or proxy.keys_file, or bind 127.0.0.1"
    )

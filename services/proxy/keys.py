"""Who may use the proxy: its keys, each naming a user.

``proxy.api_key`` is one key (user ``default``); ``proxy.keys_file`` holds one key per user, a line
``<user id> <key>`` or ``<user id> sha256:<hex digest of the key>`` each (``#`` starts a comment), so people can be
told apart and one key revoked alone. ``turnstream keys`` writes the hashed form, so the file never holds a key
anyone could use. Keys are looked up by their SHA-256, so comparing a presented key costs the same whatever it
shares with a real one. The proxy reads the file again when it changes (``ProxyKeys.reload``): a key added or
revoked takes effect without a restart; a file it cannot use leaves the keys it had.
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


HASHED = "sha256:"
"""A keys file's hashed key: ``sha256:`` and the key's SHA-256 in hex."""


def hashed(key: str) -> str:
    """What ``turnstream keys`` writes for ``key``."""
    return HASHED + hashlib.sha256(key.encode()).hexdigest()


def _line_digest(field: str) -> bytes | None:
    """The digest a keys file's second field stands for; None when it is neither a key nor a hashed one."""
    if field.startswith(HASHED):
        try:
            digest = bytes.fromhex(field.removeprefix(HASHED))
        except ValueError:
            return None
        return digest if len(digest) == 32 else None
    return _digest(field.encode()) if len(field) >= 16 else None


def read_keys_file(path: Path) -> dict[bytes, str]:
    """Key digest -> user id. Refuses duplicate keys and lines without both fields; warns when others can read it."""
    try:
        text = path.read_text()
        mode = path.stat().st_mode
    except OSError as exc:
        raise KeyFileError(f"proxy.keys_file {path}: {exc.strerror}") from None
    if mode & stat.S_IRWXO:  # group-readable is how Kubernetes mounts a Secret for a pod's fsGroup
        log.warning(f"proxy.keys_file {path} is readable by others: chmod 600 it", extra={"mode": oct(mode)})
    keys: dict[bytes, str] = {}
    for n, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        digest = _line_digest(parts[1]) if len(parts) == 2 else None
        if digest is None:
            raise KeyFileError(
                f"{path}:{n}: expected '<user id> <key>' with a key of at least 16 characters, or "
                "'<user id> sha256:<64 hex digits>'"
            )
        user = parts[0]
        if (problem := user_id_problem(user)) is not None:
            raise KeyFileError(f"{path}:{n}: {problem} (sessions are recorded as '<user id>/<session id>')")
        if digest in keys:
            raise KeyFileError(f"{path}:{n}: this key is already given to {keys[digest]!r}")
        keys[digest] = user
    return keys


def _version(path: Path) -> tuple[int, int, int] | None:
    """What tells one state of the file from the next (a rewrite in place or a rename over it, as Kubernetes
    updates a mounted Secret); None when it cannot be read."""
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size, st.st_ino


def _first_read(path: Path) -> dict[bytes, str]:
    """The keys at start. A file not made yet in a folder that is there (a deployment's mounted keys folder before
    the first ``turnstream keys add``) is no per-user keys yet, read when it appears; a missing folder is a
    mistake in the setting and is refused."""
    if not path.exists() and path.parent.is_dir():
        log.info("no keys file yet: the shared key only until one is written", extra={"file": str(path)})
        return {}
    return read_keys_file(path)


class ProxyKeys:
    def __init__(self, api_key: str | None, keys_file: str) -> None:
        self.api_key = api_key
        self.path = Path(keys_file) if keys_file else None
        self.seen = _version(self.path) if self.path is not None else None
        self.users: dict[bytes, str] = {}
        self.per_user = False
        """Users told apart: each session belongs to the user whose key started it, and a turn's ``user`` is the
        key's user, not what the client wrote."""
        self._use(_first_read(self.path) if self.path is not None else {})

    def _use(self, from_file: dict[bytes, str]) -> None:
        users = dict(from_file)
        if self.api_key:
            users[_digest(self.api_key.encode())] = DEFAULT_USER
        self.users, self.per_user = users, bool(from_file)

    def reload(self) -> bool | None:
        """Read the keys file again if it changed since last read: True when the new keys are in use, False when
        it could not be used (the keys in use stay, the error is logged), None when it did not change. Blocking
        (a stat, and a read when changed): call it in a worker thread."""
        if self.path is None or (version := _version(self.path)) == self.seen:
            return None
        self.seen = version
        try:
            from_file = read_keys_file(self.path)
        except KeyFileError as exc:
            log.error("the keys file cannot be used; the keys in use stay", extra={"error": str(exc)})
            return False
        if self.per_user and not from_file and not self.api_key:  # no key left: anyone would be served
            log.error("the keys file names no user; the keys in use stay", extra={"file": str(self.path)})
            return False
        self._use(from_file)
        log.info("keys file read again", extra={"users": len(set(from_file.values()))})
        return True

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

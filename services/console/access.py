"""Who may read the console: a token on every route, and only under host names it expects.

The console shows whole conversations. Without a token anyone who reaches its port reads them (in compose, every
container on the network); without a host check a web page the user visits can, by DNS rebinding, make the
user's browser read a console on loopback (its requests carry the attacker's host name). So every request must
name an allowed host (``console.allowed_hosts``) and carry the token: ``Authorization: Bearer <token>``, or the
cookie that ``/login?token=<token>`` sets (HttpOnly, SameSite=Strict, so another site's page cannot send it;
Secure when the request came over TLS, directly or through a proxy that says so in ``X-Forwarded-Proto``).
``/healthz`` (it says only "ok") needs no token, nor ``/favicon.ico`` (an empty answer: the browser asks for it
without the cookie).
"""

from __future__ import annotations

import hmac
from typing import Any
from urllib.parse import parse_qs

COOKIE = "turnstream_console"
LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1")
OPEN_PATHS = frozenset({"/healthz"})


def host_name(host_header: str) -> str:
    """The host of a ``Host`` header, without its port; IPv6 literals without their brackets."""
    if host_header.startswith("["):
        return host_header[1 : host_header.find("]")] if "]" in host_header else host_header
    return host_header.rsplit(":", 1)[0] if host_header.count(":") == 1 else host_header


def allowed_hosts(configured: list[str], bind_host: str) -> frozenset[str]:
    """The configured names, or when none: loopback's and the address the console binds (unless a wildcard)."""
    if configured:
        return frozenset(h.lower().strip("[]") for h in configured)
    extra = () if bind_host in ("0.0.0.0", "::", "") else (bind_host.strip("[]"),)
    return frozenset((*LOCAL_HOSTS, *extra))


def _page(status: int, title: str, text: str) -> tuple[int, bytes]:
    body = (
        f"<!doctype html><meta charset=utf-8><title>{title}</title>"
        f"<body style='font-family:sans-serif;max-width:40em;margin:3em auto'><h1>{title}</h1><p>{text}</p>"
    )
    return status, body.encode()


class Access:
    """ASGI middleware in front of the console's application."""

    def __init__(self, app: Any, token: str, hosts: frozenset[str]) -> None:
        if not token:
            raise ValueError("the console needs a token")
        self.app = app
        self.token = token.encode()
        self.hosts = hosts

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        host = host_name(headers.get(b"host", b"").decode("latin-1")).lower()
        if "*" not in self.hosts and host not in self.hosts:
            await _send(send, *_page(421, "Unknown host", "This console does not answer to that host name."))
            return
        path = scope["path"]
        if path in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        if path == "/favicon.ico":  # asked by the browser itself, without the login cookie; nothing to show
            await _send(send, 204, b"")
            return
        if path == "/login":
            given = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("token", [""])[0]
            if self._valid(given.encode()):
                secure = "; Secure" if _over_tls(scope, headers) else ""
                cookie = f"{COOKIE}={given}; HttpOnly; SameSite=Strict; Path=/{secure}"
                await _send(send, 303, b"", [(b"location", b"/"), (b"set-cookie", cookie.encode())])
            else:
                await _send(send, *_refusal(path))
            return
        if self._valid(_bearer(headers) or _cookie(headers)):
            await self.app(scope, receive, send)
            return
        await _send(send, *_refusal(path))

    def _valid(self, given: bytes) -> bool:
        return bool(given) and hmac.compare_digest(given, self.token)


def _over_tls(scope: dict[str, Any], headers: dict[bytes, bytes]) -> bool:
    """Whether the browser reached the console over TLS. A forged ``X-Forwarded-Proto`` only adds ``Secure`` to the
    cookie of whoever forged it."""
    forwarded = headers.get(b"x-forwarded-proto", b"").split(b",")[0].strip().lower()
    return scope.get("scheme") == "https" or forwarded == b"https"


def _bearer(headers: dict[bytes, bytes]) -> bytes:
    scheme, _, value = headers.get(b"authorization", b"").partition(b" ")
    return value.strip() if scheme.lower() == b"bearer" else b""


def _cookie(headers: dict[bytes, bytes]) -> bytes:
    for part in headers.get(b"cookie", b"").split(b";"):
        name, _, value = part.strip().partition(b"=")
        if name == COOKIE.encode():
            return value
    return b""


def _refusal(path: str) -> tuple[int, bytes]:
    if path.startswith("/api/") or path == "/metrics":
        return 401, b'{"error":{"message":"a valid console token is required","type":"unauthorized"}}'
    return _page(
        401,
        "Login needed",
        "This console shows people's conversations, so it needs its token. Open the login link that "
        "<code>turnstream console</code> (or <code>turnstream run</code>) printed, or send "
        "<code>Authorization: Bearer &lt;token&gt;</code>.",
    )


async def _send(
    send: Any, status: int, body: bytes, headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    kind = b"application/json" if body.startswith(b"{") else b"text/html; charset=utf-8"
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", kind),
                (b"content-length", str(len(body)).encode()),
                (b"cache-control", b"no-store"),
                *(headers or []),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})

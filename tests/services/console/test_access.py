"""Who may read the console (issue 32, item 2): ``turnstream console`` as a process, on the real broker. Every route
that shows data needs the token; a host name it does not expect is refused even with the token (DNS rebinding);
the login link sets a cookie a browser keeps and another site's page cannot send."""

from __future__ import annotations

import re
import stat
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from runtime.configuration.config import KafkaConfig
from runtime.process.launch import ServiceProcess
from runtime.process.ports import free_port

pytestmark = pytest.mark.integration

DATA_ROUTES = [
    "/",
    "/sessions",
    "/sessions/s1",
    "/turns/s1:1",
    "/versions",
    "/api/overview",
    "/api/sessions",
    "/api/turns/s1:1",
    "/api/versions",
    "/metrics",
]


@pytest.fixture
def console(kafka: KafkaConfig, tmp_path: Path) -> Iterator[tuple[str, Path]]:
    port = free_port()
    log = tmp_path / "console.log"
    with log.open("w") as out:
        proc = ServiceProcess(
            ["console", "--port", str(port)],
            port=port,
            ready_path="/healthz",
            env={
                **kafka.client_env(),
                "TURNSTREAM_KAFKA_SEAL_KEYS_URL": kafka.seal_keys_url,
                "TURNSTREAM_CACHE": str(tmp_path / "cache"),
                "TURNSTREAM_CONSOLE_DB_PATH": str(tmp_path / "console.sqlite3"),
                "TURNSTREAM_LOGGING_FORMAT": "text",
            },
            log=out,
            startup_timeout_s=60,
        )
        try:
            yield f"http://127.0.0.1:{port}", log
        finally:
            proc.stop()


def test_every_data_route_needs_the_token_and_a_known_host(console: tuple[str, Path], tmp_path: Path) -> None:
    url, log = console
    token_file = tmp_path / "token"  # beside the projection
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    assert stat.S_IMODE(token_file.parent.stat().st_mode) == 0o700
    # The projection holds whole conversations: its file, WAL and shared memory are the owner's alone (issue 32).
    projection = sorted(tmp_path.glob("console.sqlite3*"))
    assert len(projection) >= 2, projection  # the database and its WAL
    assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in projection} == {p.name: 0o600 for p in projection}
    token = token_file.read_text().strip()
    # Where to log in, without the token (issue 55: logs are collected and kept).
    link = re.search(r"open (http://\S+/login)\?token=<console.token>", log.read_text())
    assert link and link.group(1) == url + "/login" and token not in log.read_text(), log.read_text()[-2000:]

    with httpx.Client(base_url=url, timeout=30) as http:
        assert http.get("/healthz").status_code == 200
        icon = http.get(
            "/favicon.ico"
        )  # Chromium asks without the cookie; a 401 there is an error in its console
        assert icon.status_code == 204 and icon.content == b""
        for route in DATA_ROUTES:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Cookie": "turnstream_console=wrong"}):
                r = http.get(route, headers=headers)
                assert r.status_code == 401, (route, headers, r.status_code)
                if route.startswith("/api/") or route == "/metrics":
                    assert r.json()["error"]["type"] == "unauthorized"
        bearer = {"Authorization": f"Bearer {token}"}
        for route in ("/", "/api/sessions", "/metrics"):
            assert http.get(route, headers=bearer).status_code == 200, route
        # DNS rebinding: the browser sends the attacker's host name; refused, token or not.
        for host in ("attacker.example", "attacker.example:8080", "127.0.0.1.attacker.example"):
            r = http.get("/api/sessions", headers={**bearer, "Host": host})
            assert r.status_code == 421, (host, r.status_code)
        assert http.get("/api/sessions", headers={**bearer, "Host": "localhost:1234"}).status_code == 200

        wrong = http.get("/login", params={"token": "nope"}, follow_redirects=False)
        assert wrong.status_code == 401 and "set-cookie" not in wrong.headers
        login = http.get("/login", params={"token": token}, follow_redirects=False)
        assert login.status_code == 303 and login.headers["location"] == "/"
        cookie = login.headers["set-cookie"]
        assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and "Secure" not in cookie
        # Behind a TLS-terminating ingress (issue 55): the cookie never goes out over plain HTTP.
        tls = http.get(
            "/login", params={"token": token}, headers={"X-Forwarded-Proto": "https"}, follow_redirects=False
        )
        assert tls.status_code == 303 and "; Secure" in tls.headers["set-cookie"]
        http.cookies.clear()
        r = http.get("/api/sessions", headers={"Cookie": f"turnstream_console={token}"})
        assert r.status_code == 200

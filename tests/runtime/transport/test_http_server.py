"""LeanServer: uvicorn without its 10 Hz tick still stops at once on a signal, keeps its Date header current and
reports a failed start."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest

from runtime.process.launch import ServiceProcess
from runtime.process.ports import free_port

ROOT = Path(__file__).resolve().parents[3]
ENV = {"PYTHONPATH": str(ROOT)}  # the app script lives in a temporary folder

APP = textwrap.dedent(
    """
    import sys
    from runtime.transport.http_server import serve

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    serve(app, tick_s=float(sys.argv[2]), host="127.0.0.1", port=int(sys.argv[1]), log_level="warning",
          lifespan="off")
    """
)


@pytest.fixture
def app_script(tmp_path: Path) -> Path:
    script = tmp_path / "lean_app.py"
    script.write_text(APP)
    return script


def start(script: Path, tick_s: float) -> ServiceProcess:
    port = free_port()
    return ServiceProcess(
        [str(port), str(tick_s)], port=port, ready_path="/", program=[sys.executable, str(script)],
        env=ENV, startup_timeout_s=30,
    )  # fmt: skip


def test_a_signal_stops_the_server_without_waiting_for_the_tick(app_script: Path) -> None:
    # Were the signal not to wake the loop, stopping would take 2 minutes (and end in SIGKILL after 30 s).
    server = start(app_script, tick_s=120)
    t0 = time.monotonic()
    code = server.stop()  # SIGTERM; SIGKILL (code None) after 30 s
    assert time.monotonic() - t0 < 20
    assert code == -signal.SIGTERM  # uvicorn re-raises the signal it shut down for


def test_the_date_header_follows_the_clock(app_script: Path) -> None:
    with start(app_script, tick_s=1.0) as server:
        first = httpx.get(server.url + "/").headers["date"]
        time.sleep(2.5)
        assert httpx.get(server.url + "/").headers["date"] != first


def test_a_port_in_use_is_a_failed_start(app_script: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run(
            [sys.executable, str(app_script), str(port), "1.0"],
            capture_output=True,
            timeout=60,
            env={**os.environ, **ENV},
        )
    from uvicorn.main import STARTUP_FAILURE

    assert proc.returncode == STARTUP_FAILURE, proc.stderr.decode()[-2000:]

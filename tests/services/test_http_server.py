"""LeanServer: uvicorn without its 10 Hz tick still stops at once on a signal, keeps its Date header current and
reports a failed start."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import textwrap
import time

import httpx

from services.engine.launch import free_port

APP = textwrap.dedent(
    """
    import sys
    from services.http_server import serve

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    serve(app, tick_s=float(sys.argv[2]), host="127.0.0.1", port=int(sys.argv[1]), log_level="warning",
          lifespan="off")
    """
)


def start(port: int, tick_s: float) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([sys.executable, "-c", APP, str(port), str(tick_s)])
    deadline = time.monotonic() + 30
    while True:
        try:
            httpx.get(f"http://127.0.0.1:{port}/", timeout=1)
            return proc
        except httpx.HTTPError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise AssertionError("the server did not come up") from None
            time.sleep(0.05)


def test_a_signal_stops_the_server_without_waiting_for_the_tick() -> None:
    proc = start(
        free_port(), tick_s=120
    )  # were the signal not to wake the loop, stopping would take 2 minutes
    try:
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=20)
        assert time.monotonic() - t0 < 20
        assert proc.returncode == -signal.SIGTERM  # uvicorn re-raises the signal it shut down for
    finally:
        if proc.poll() is None:
            proc.kill()


def test_the_date_header_follows_the_clock() -> None:
    port = free_port()
    proc = start(port, tick_s=1.0)
    try:
        first = httpx.get(f"http://127.0.0.1:{port}/").headers["date"]
        time.sleep(2.5)
        later = httpx.get(f"http://127.0.0.1:{port}/").headers["date"]
        assert later != first
    finally:
        proc.terminate()
        proc.wait(20)


def test_a_port_in_use_is_a_failed_start() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run([sys.executable, "-c", APP, str(port), "1.0"], capture_output=True, timeout=60)
    from uvicorn.main import STARTUP_FAILURE

    assert proc.returncode == STARTUP_FAILURE, proc.stderr.decode()[-2000:]

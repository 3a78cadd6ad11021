"""Start a turnstream service as a subprocess and wait until it answers (tests, benchmarks, local runs)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from typing import IO

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServiceProcess:
    """``python -m services.cli <args>`` with ``env`` added to this process's environment; ready once
    ``GET <url><ready_path>`` answers 200."""

    def __init__(
        self,
        args: Sequence[str],
        *,
        port: int,
        ready_path: str,
        env: Mapping[str, str] | None = None,
        log: IO[str] | None = None,
        startup_timeout_s: float = 180.0,
    ) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.name = args[0]
        self._devnull = None if log is not None else open(os.devnull, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "services.cli", *args],
            env={**os.environ, "TURNSTREAM_LOGGING_FORMAT": "text", **(env or {})},
            stdout=log or self._devnull,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + startup_timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode} before it was ready")
            try:
                if httpx.get(self.url + ready_path, timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"{self.name} was not ready within {startup_timeout_s} s")
            time.sleep(0.2)

    def stop(self) -> None:
        """SIGTERM (services finish in-flight work and flush), then SIGKILL after 30 s."""
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self._devnull is not None:
            self._devnull.close()

    def __enter__(self) -> ServiceProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

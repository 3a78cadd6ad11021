"""Start ``turnstream engine`` as a subprocess and wait until it is healthy (tests, benchmarks, ``turnstream
run``)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class EngineProcess:
    def __init__(
        self,
        model: str | Path,
        *extra: str,
        port: int | None = None,
        log: IO[str] | None = None,
        startup_timeout_s: float = 180.0,
        threads: int = 1,
    ) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._devnull = None if log is not None else open(os.devnull, "w")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "services.cli",
                "engine",
                "--model",
                str(model),
                "--port",
                str(self.port),
                "--threads",
                str(threads),
                *extra,
            ],
            env={**os.environ, "OMP_NUM_THREADS": str(threads), "TURNSTREAM_LOGGING_FORMAT": "text"},
            stdout=log or self._devnull,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + startup_timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"engine exited with {self.proc.returncode} before becoming healthy")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"engine did not become healthy within {startup_timeout_s} s")
            time.sleep(0.3)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self._devnull is not None:
            self._devnull.close()

    def __enter__(self) -> EngineProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

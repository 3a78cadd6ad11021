"""Start ``turnstream engine`` as a subprocess and wait until it is healthy."""

from __future__ import annotations

from pathlib import Path
from typing import IO

from services.launch import ServiceProcess, free_port

__all__ = ["EngineProcess", "free_port"]


class EngineProcess(ServiceProcess):
    def __init__(
        self,
        model: str | Path,
        *extra: str,
        port: int | None = None,
        log: IO[str] | None = None,
        startup_timeout_s: float = 180.0,
        threads: int = 1,
    ) -> None:
        port = port or free_port()
        super().__init__(
            ["engine", "--model", str(model), "--port", str(port), "--threads", str(threads), *extra],
            port=port,
            ready_path="/health",
            env={"OMP_NUM_THREADS": str(threads)},
            log=log,
            startup_timeout_s=startup_timeout_s,
        )
